"""Shape arithmetic after a depth-attention site folds at import, as it does before one.

TVM's importer needs a Reshape's target as constants or a shape it can follow; the pre-pass
(onnx_prepare.simplify) folds the run-time shape arithmetic of exports into constants once
`--static-shape` fixes the input. It saw no shape on a site's output (node-level shape inference knows no `attnres` op),
so a Reshape after the sites stayed a run-time target: PP-OCRv4 rec stopped at `p2o.Reshape.73`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from attnres_compile.backends.tvm.importers import import_model
from attnres_compile.backends.tvm.pipeline import build, make_target
from attnres_compile.onnx.pipeline import rewrite_onnx
from attnres_compile.onnx.function import DOMAIN

RTOL = 1e-4  # against onnxruntime, relative to the output's largest magnitude


def _heads_after_residuals(path: Path, blocks: int) -> None:
    """`blocks` residual blocks over x [batch, seq, 16], then a reshape of Sigmoid(x) into heads by a target
    built at run time as paddle2onnx writes it: [0, Cast(Slice(Cast(Shape(x), int32), 1:2)), 2, 8]
    (of x, not of the data, and transposed: onnxscript reads a Reshape's target off its data's dims
    or off its output's declared dims without folding)."""
    rng = np.random.default_rng(0)
    nodes, x = [], "x"
    weights = [numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32) * 0.3, f"w{i}")
               for i in range(blocks)]
    for i in range(blocks):
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"mm{i}"]), helper.make_node("Relu", [f"mm{i}"], [f"r{i}"]),
                  helper.make_node("Add", [x, f"r{i}"], [f"h{i}"])]
        x = f"h{i}"
    consts = {"zero": [0], "one": [1], "two": [2], "heads": [2, 8]}
    weights += [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in consts.items()]
    nodes += [helper.make_node("Shape", [x], ["shape"]),
              helper.make_node("Cast", ["shape"], ["shape32"], to=TensorProto.INT32),
              helper.make_node("Slice", ["shape32", "one", "two", "zero", "one"], ["seq32"]),
              helper.make_node("Cast", ["seq32"], ["seq"], to=TensorProto.INT64),
              helper.make_node("Concat", ["zero", "seq", "heads"], ["target"], axis=0),
              helper.make_node("Sigmoid", [x], ["gate"]), helper.make_node("Reshape", ["gate", "target"], ["split"]),
              helper.make_node("Transpose", ["split"], ["y"], perm=[0, 2, 1, 3])]
    graph = helper.make_graph(nodes, "heads",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, "seq", 8])], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def _compiled_output(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The model at `path` built for this CPU at the feeds' shapes, run on them."""
    shapes = {k: v.shape for k, v in feeds.items()}
    imported = import_model(path, shapes)
    vm = relax.VirtualMachine(build(imported, make_target("llvm"), input_shapes=shapes).executable, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(feeds[n]) for n in imported.inputs]).numpy()


def _check(path: Path, feeds: dict[str, np.ndarray]) -> None:
    (expected,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    actual = _compiled_output(path, feeds)
    assert actual.shape == expected.shape
    assert np.abs(actual - expected).max() <= RTOL * np.abs(expected).max()


@pytest.mark.parametrize("blocks, op_type", [(3, "DepthAttention"), (9, "DepthAttentionMerge")])
def test_a_reshape_by_run_time_dims_after_a_site(tmp_path, blocks, op_type):
    """The fixture rewritten (its last residual add becomes a site, the Reshape target read from the
    site's output; at 9 blocks Full AttnRes groups the sites in threes, each a Merge): imported at a
    fixed shape, built, against onnxruntime."""
    _heads_after_residuals(tmp_path / "heads.onnx", blocks)
    result = rewrite_onnx(tmp_path / "heads.onnx", tmp_path / "heads_ar.onnx", verify_outputs=False)
    assert result.report["summary"]["sites_rewritten"] == blocks
    assert {n.op_type for n in onnx.load(str(tmp_path / "heads_ar.onnx")).graph.node if n.domain == DOMAIN} >= {op_type}
    x = np.random.default_rng(1).standard_normal((2, 5, 16)).astype(np.float32)
    _check(tmp_path / "heads_ar.onnx", {"x": x})


@pytest.mark.heavy
def test_pp_ocrv4_rec_compiles_before_and_after_the_rewrite(tmp_path):
    """PP-OCRv4 rec (rapidocr-onnxruntime's file): its Reshape after the four sites converts, and both
    the original and the rewritten model match onnxruntime at a fixed input shape."""
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None:
        pytest.skip("rapidocr-onnxruntime is not installed: pip install --no-deps rapidocr-onnxruntime")
    original = Path(spec.submodule_search_locations[0]) / "models" / "ch_PP-OCRv4_rec_infer.onnx"
    result = rewrite_onnx(original, tmp_path / "rec_ar.onnx", verify_outputs=False)
    assert result.report["summary"]["sites_rewritten"] == 4
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 3, 48, 64)).astype(np.float32)}
    for path in (original, tmp_path / "rec_ar.onnx"):
        _check(path, feeds)
