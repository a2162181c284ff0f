"""Dims the ONNX file names hold while TVM imports it (named_dims.py), and integer Div of a dim as
floordiv (onnx_prepare._dim_quotient).

wav2vec2 and HuBERT with Block sites at a symbolic length failed to build: the positional conv's
`[..., :-1]` came out of TVM's Slice converter as `min(max(s//10 - 1, 0), s//10)` and the stock
Div converter wrote `T.Div(s, 10) - 1`, where the file's value_info says `((s//10)) - 1` for both;
the block sums of those values got no shape ("emit_te now only supports Tensor that has ShapeExpr
shape"). The graph below is the same pattern in four nodes.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers as tf
import tvm
import tvm_ffi
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from attnres_compile import AttnResConfig
from attnres_compile.backends.tvm import compile_model, load
from attnres_compile.backends.tvm.artifact import dim_text
from attnres_compile.backends.tvm.check import run
from attnres_compile.backends.tvm.importers import import_model
from attnres_compile.backends.tvm.onnx_prepare import _dim_quotient
from attnres_compile.backends.tvm.pipeline import build, make_target
from attnres_compile.core.errors import CompileError
from attnres_compile.onnx.pipeline import export_onnx

RTOL = 1e-5  # against onnxruntime, relative to the output's largest magnitude


def _sliced_beside_conv(names: dict[str, str] | None) -> onnx.ModelProto:
    """x[1, 1, s] -> f = Conv stride 10 ([1, 4, s//10]); f[..., :-1] + Conv(f, kernel 2): both s//10 - 1
    long; `names`: the value_info dim names of f, g (the slice) and c (the second conv)."""
    rng = np.random.default_rng(0)
    value = lambda n, d: helper.make_tensor_value_info(n, TensorProto.FLOAT, d)  # noqa: E731
    ints = lambda n, v: numpy_helper.from_array(np.array(v, np.int64), n)  # noqa: E731
    nodes = [helper.make_node("Conv", ["x", "w1"], ["f"], strides=[10]),
             helper.make_node("Slice", ["f", "start", "end", "axis"], ["g"]),
             helper.make_node("Conv", ["f", "w2"], ["c"]),
             helper.make_node("Add", ["g", "c"], ["y"])]
    graph = helper.make_graph(
        nodes, "sliced", [value("x", [1, 1, "s"])], [value("y", [1, 4, None])],
        [numpy_helper.from_array(rng.standard_normal((4, 1, 10)).astype(np.float32), "w1"),
         numpy_helper.from_array(rng.standard_normal((4, 4, 2)).astype(np.float32), "w2"),
         ints("start", [0]), ints("end", [-1]), ints("axis", [2])],
        value_info=[value(n, [1, 4, d]) for n, d in (names or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


TRUE_NAMES = {"f": "s // 10", "g": "((s//10)) - 1", "c": "((s//10)) - 1"}


def _reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_a_named_dim_joins_what_the_converters_wrote_apart(tmp_path):
    model = _sliced_beside_conv(TRUE_NAMES)
    onnx.save(model, tmp_path / "m.onnx")
    main = import_model(tmp_path / "m.onnx").mod["main"]
    assert dim_text(main.ret_ty.shape.values[2]) == "s // 10 - 1"
    casts = [b for block in main.body.blocks for b in block.bindings if isinstance(b, relax.MatchCast)]
    assert len(casts) == 1  # the slice only: the convs' dims are proven equal to their names
    executable = build(import_model(tmp_path / "m.onnx"), make_target("llvm")).executable
    for length in (400, 409, 1000):
        x = np.random.default_rng(length).standard_normal((1, 1, length)).astype(np.float32)
        expected = _reference(model, x)
        got = run(executable, tvm.cpu(), [x])[0]
        assert got.shape == expected.shape == (1, 4, length // 10 - 1)
        np.testing.assert_allclose(got, expected, rtol=0, atol=RTOL * np.abs(expected).max())


def test_without_names_the_sum_has_no_shape(tmp_path):
    """The same graph with no value_info: the add's shape stays unknown and the build fails with
    its hint, as every such model did before."""
    onnx.save(_sliced_beside_conv(None), tmp_path / "m.onnx")
    imported = import_model(tmp_path / "m.onnx")
    assert not isinstance(imported.mod["main"].ret_ty.shape, relax.ShapeExpr)
    with pytest.raises(CompileError, match=r"--static-shape x:1x1x\{s\}"):
        build(imported, make_target("llvm"))


def test_a_file_whose_names_lie_stops_when_it_runs(tmp_path):
    """Names that claim a wrong length are checked where the model runs, never computed with."""
    model = _sliced_beside_conv({"f": "s // 10", "g": "s // 10", "c": "s // 10"})
    onnx.save(model, tmp_path / "m.onnx")
    executable = build(import_model(tmp_path / "m.onnx"), make_target("llvm")).executable
    with pytest.raises(RuntimeError, match=r"match_cast error, +shape\[2\] mismatch"):
        run(executable, tvm.cpu(), [np.zeros((1, 1, 400), np.float32)])


def test_integer_div_of_a_dim_is_floordiv():
    s = tvm.tirx.Var("s", "int64")
    ten = relax.const(np.array(10, np.int64))
    assert _dim_quotient(s - 1, ten) is None  # s - 1 < 0 at s = 0, where truncdiv and floordiv differ
    assert tvm_ffi.structural_equal(_dim_quotient(s * 2 + 3, ten), tvm.tirx.floordiv(s * 2 + 3, tvm.tirx.IntImm("int64", 10)))
    assert _dim_quotient(s, relax.const(np.array(-2, np.int64))) is None  # truncdiv and floordiv differ
    assert _dim_quotient(s, relax.const(np.array(0, np.int64))) is None
    assert _dim_quotient(s, relax.const(np.array(2.0, np.float32))) is None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["wav2vec2", pytest.param("hubert", marks=pytest.mark.heavy)])
def test_audio_encoder_with_block_sites_builds_at_any_length(tmp_path, name):
    """A tiny HF wav2vec2 / HuBERT, Block(2) ONNX with a dynamic batch and length, compiled with no
    flags: verified against onnxruntime by `compile_model`, then run at lengths it was not built at."""
    config = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                  conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                  num_conv_pos_embedding_groups=4, do_stable_layer_norm=True)
    cls, cfg = {"wav2vec2": (tf.Wav2Vec2Model, tf.Wav2Vec2Config), "hubert": (tf.HubertModel, tf.HubertConfig)}[name]
    torch.manual_seed(0)
    model = cls(cfg(**config)).eval()
    audio = torch.randn(2, 400)
    path = tmp_path / f"{name}.onnx"
    export_onnx(model, (audio,), path, AttnResConfig(variant="block", num_blocks=2))
    manifest = compile_model(path, tmp_path / "art")
    assert all(row["ok"] for row in manifest["verification"]["rows"]), manifest["verification"]
    artifact = load(tmp_path / "art")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for shape in ((1, 800), (3, 1609)):
        x = np.random.default_rng(shape[1]).standard_normal(shape).astype(np.float32)
        expected = session.run(["last_hidden_state"], {"input_values": x})[0]
        got = artifact(input_values=x)["last_hidden_state"]
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
