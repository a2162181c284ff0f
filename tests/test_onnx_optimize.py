"""onnxscript's optimizer keeps a tiny epsilon: its no-op rules apply to exact 0 and 1 only (onnx/optimize.py)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from attnres_compile import AttnResConfig
from attnres_compile.backends.tvm.onnx_prepare import simplify
from attnres_compile.onnx.pipeline import export_onnx


def _model(constants: dict[str, float]) -> onnx.ModelProto:
    """y = x <op> c for each (op, c), chained: x [2, 4] float."""
    nodes, inits, name = [], [], "x"
    for i, (op, c) in enumerate(constants.items()):
        inits.append(helper.make_tensor(f"c{i}", TensorProto.FLOAT, [], [c]))
        nodes.append(helper.make_node(op.rstrip("0123456789"), [name, f"c{i}"], [f"y{i}"]))
        name = f"y{i}"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_tiny_constants_stay_and_exact_neutral_ones_go():
    kept = {"Add": 1e-8, "Sub": 1e-9, "Mul": 1.000001, "Div": 0.9999995}
    folded = simplify(_model({**kept, "Add1": 0.0, "Mul1": 1.0}))
    assert sorted(n.op_type for n in folded.graph.node) == sorted(kept)


def test_helium_pad_row_stays_finite_in_onnx(tmp_path):
    """Helium's RMSNorm adds eps 1e-8 and its pad token's embedding row is zero: without the eps, onnxruntime
    computes rsqrt(0) * 0 = NaN for every pad position, where torch gives finite logits."""
    transformers = pytest.importorskip("transformers")
    config = transformers.HeliumConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=3)
    torch.manual_seed(0)
    model = transformers.HeliumForCausalLM(config).eval()
    assert config.rms_norm_eps == 1e-8 and not model.model.embed_tokens.weight[3].any()
    ids = torch.tensor([[5, 3, 7, 9, 3, 2, 1, 4]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    with torch.no_grad():
        expected = model(**inputs).logits.numpy()
    export_onnx(model, inputs, tmp_path / "helium.onnx", AttnResConfig(variant="block", block_size=2),
                verify_outputs=False)
    session = ort.InferenceSession(str(tmp_path / "helium.onnx"))
    actual = session.run(["logits"] if "logits" in [o.name for o in session.get_outputs()] else None,
                         {"input_ids": ids.numpy(), "attention_mask": np.ones_like(ids.numpy())})[0]
    assert np.isfinite(actual).all()
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
