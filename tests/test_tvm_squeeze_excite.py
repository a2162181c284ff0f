"""The default CPU build on squeeze-excite blocks (a torch SE block; PaddleOCR's MobileNetV3 det and
cls from rapidocr-onnxruntime) against onnxruntime, and the fallback to the next rule where a
rule's schedule does not lower.

A squeeze-excite pools a map to [1, C, 1, 1] and runs 1x1 convolutions or linears on it: outputs
with no axis beyond their rows, whose row loop `RowReduction` vectorised around the row's stages,
and the whole build failed ("VectorizeLoop before LiftStorageAlloc").
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import tvm
from tvm import s_tir, te
from tvm.s_tir import dlight

from attnres_compile import AttnResConfig
from attnres_compile.backends.tvm import compile_model, load
from attnres_compile.backends.tvm.check import run
from attnres_compile.backends.tvm.cpu_rules import Injective, RowReduction, default_rules, lowers
from attnres_compile.backends.tvm.importers import import_model
from attnres_compile.backends.tvm.lowerable import Lowerable
from attnres_compile.backends.tvm.pipeline import build, lower, make_target, prepare
from attnres_compile.onnx.pipeline import export_onnx

RTOL = 1e-4  # against onnxruntime, relative to the output's largest magnitude
SHAPE = (1, 3, 16, 16)


class SqueezeExcite(torch.nn.Module):
    """A conv stem, a 1x1-conv squeeze-excite and a linear one (each a residual link), a linear head."""

    def __init__(self, channels: int = 16, reduction: int = 4):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, channels, 3, padding=1)
        self.squeeze = torch.nn.Conv2d(channels, channels // reduction, 1)
        self.excite = torch.nn.Conv2d(channels // reduction, channels, 1)
        self.down = torch.nn.Linear(channels, channels // reduction)
        self.up = torch.nn.Linear(channels // reduction, channels)
        self.head = torch.nn.Linear(channels, 10)

    def forward(self, x):
        y = torch.relu(self.stem(x))
        y = y * torch.sigmoid(self.excite(torch.relu(self.squeeze(y.mean((2, 3), keepdim=True))))) + y
        y = y * torch.sigmoid(self.up(torch.relu(self.down(y.mean((2, 3))))))[:, :, None, None] + y
        return self.head(y.mean((2, 3)))


def _close(expected: np.ndarray, actual: np.ndarray) -> None:
    assert float(np.abs(expected - actual).max() / np.abs(expected).max()) <= RTOL


@pytest.fixture(scope="module")
def squeeze_excite(tmp_path_factory):
    """(its AttnRes ONNX file, an input): the SE block rewritten (two links, one site each)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("se") / "se.onnx"
    x = torch.randn(SHAPE)
    export_onnx(SqueezeExcite().eval(), (x,), path, AttnResConfig())
    return path, {"x": x.numpy()}


def test_row_reduction_leaves_outputs_without_an_axis_beyond_the_rows(squeeze_excite):
    """Each of the SE model's operators that RowReduction schedules lowers; the pooled 1x1
    convolutions and linears it used to vectorise around their reductions are left to dlight."""
    path, _ = squeeze_excite
    imported, target = import_model(path, {"x": SHAPE}), make_target("llvm")
    mod = prepare(lower(imported.mod, target, len(imported.sites))[0], target)
    scheduled = 0
    with target:
        for func in mod.functions.values():
            if isinstance(func, tvm.tirx.PrimFunc) and "tirx.is_scheduled" not in func.attrs:
                sch = RowReduction().apply(func, target, False)
                if sch is not None:
                    lowers(sch, target)
                    scheduled += 1
    assert scheduled  # the excite conv fused with its gating multiply: [1, C, H, W] out, axes beyond the rows


def test_squeeze_excite_block_compiles_and_matches_onnxruntime(squeeze_excite, tmp_path):
    path, feeds = squeeze_excite
    manifest = compile_model(path, tmp_path / "art", static_shapes={"x": SHAPE})
    assert len(manifest["sites"]) == 2
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    _close(expected, next(iter(load(tmp_path / "art")(feeds).values())))


class _VectoriseWhole(dlight.ScheduleRule):
    """Vectorises an elementwise operator's only loop whatever its extent: TVM cannot lower a
    vectorised loop of symbolic extent on x86 ("Failed to vectorize loop with extent n")."""

    def apply(self, func, target, tunable):
        sch = s_tir.Schedule(func)
        (block,) = sch.get_child_blocks(sch.get_sblock("root"))
        sch.vectorize(sch.get_loops(block)[0])
        return sch


def test_a_rule_whose_schedule_does_not_lower_passes_the_operator_on():
    """The first rule's schedule fails TVM's lowering: Lowerable refuses it, the next rule
    (Injective) schedules the operator, and the build runs against numpy at n = 37."""
    n = te.var("n", "int64")
    a = te.placeholder((n,), name="a")
    func = te.create_prim_func([a, te.compute((n,), lambda i: a[i] * 2.0 + 1.0, name="b")])
    target = make_target("llvm")
    with target:
        with pytest.raises(Exception, match="Failed to vectorize loop"):
            lowers(_VectoriseWhole().apply(func, target, False), target)
        assert Lowerable(_VectoriseWhole(), lowers).apply(func, target, False) is None
        mod = dlight.ApplyDefaultSchedule(Lowerable(_VectoriseWhole(), lowers), Lowerable(Injective(), lowers))(
            tvm.IRModule({"main": func.with_attr("global_symbol", "main")}))
    assert mod["main"].attrs["tirx.is_scheduled"]
    x = np.arange(37, dtype=np.float32)
    args = [tvm.runtime.tensor(x), tvm.runtime.tensor(np.zeros_like(x))]
    tvm.compile(mod, target)(*args)
    np.testing.assert_array_equal(args[1].numpy(), x * 2 + 1)
    assert all(isinstance(rule, Lowerable) for rule in default_rules())


def test_paddle_unknown_input_dims_take_a_static_shape(tmp_path):
    """Paddle's exports write unknown dims as dim_value -1 and as "?" (PaddleOCR's cls: [-1, 3, ?, ?]);
    --static-shape x:2x3x4x5 refused them as "dim -1 is static" and as "? two sizes: 4 and 5"."""
    dims = [-1, 3, "?", "?"]
    x, y = (onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, dims) for n in "xy")
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "paddle_dims", [x], [y])
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    imported = import_model(tmp_path / "m.onnx", {"x": (2, 3, 4, 5)})
    assert [int(d) for d in imported.mod["main"].params[0].ty.shape.values] == [2, 3, 4, 5]


def _text_image(height: int, width: int) -> np.ndarray:
    """Dark strokes on white, normalised as PaddleOCR does: the det map spans 0 to 1 (on noise it is
    ~1e-5 everywhere, where onnxruntime's own sigmoid is off by 1e-7: 1% of that magnitude)."""
    image = np.ones((height, width), np.float32)
    image[height // 3:height // 2, width // 8:-width // 8] = 0
    image[height // 3:height // 2, width // 8:-width // 8:6] = 1
    image[2 * height // 3:3 * height // 4, width // 5:2 * width // 3] = 0
    return np.broadcast_to((image - 0.5) / 0.5, (1, 3, height, width)).copy()


@pytest.mark.slow
@pytest.mark.parametrize("name, shape", [pytest.param("ch_PP-OCRv4_det_infer", (1, 3, 64, 64), marks=pytest.mark.heavy),
                                         ("ch_ppocr_mobile_v2.0_cls_infer", (1, 3, 48, 192))])
def test_paddleocr_mobilenetv3_compiles_and_matches_onnxruntime(name, shape):
    """PaddleOCR's det and cls (MobileNetV3 with squeeze-excite, symbolic image size), at a fixed size. The det
    model's build (20 s) runs under -m heavy: the cls model takes the same squeeze-excite path."""
    spec = importlib.util.find_spec("rapidocr_onnxruntime")  # its package imports cv2: only the files are used
    if spec is None:
        pytest.skip("rapidocr-onnxruntime is not installed: pip install --no-deps rapidocr-onnxruntime")
    path = Path(spec.submodule_search_locations[0]) / "models" / f"{name}.onnx"
    feeds = {"x": _text_image(*shape[2:])}
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    imported = import_model(path, {"x": shape})
    built = build(imported, make_target("llvm"), input_shapes={"x": shape})
    _close(expected, run(built.executable, tvm.cpu(), [feeds["x"]])[0])
