"""Verification shapes: symbolic dims filled consistently (dim expressions, decoder-with-past files)
and checked at two shape sets (the default and all free dims at 1)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from attnres_compile.onnx import runtime as ort_backend
from attnres_compile.cli import main
from attnres_compile.core.errors import ConfigError, ModelRunError
from attnres_compile.onnx.pipeline import rewrite_onnx
from attnres_compile.onnx import dims as onnx_dims
from attnres_compile.core import verify

sys.path.insert(0, str(Path(__file__).parent))

import decoder_with_past  # noqa: E402

DECODER = {"input_ids": ["batch_size", "sequence_length"],
           "attention_mask": ["batch_size", "past_sequence_length + sequence_length"],
           "past_key_values.0.key": ["batch_size", 2, "past_sequence_length", 16]}


def test_parse_linear_dim_expressions():
    assert onnx_dims.parse("past_sequence_length + sequence_length") == {"past_sequence_length": 1, "sequence_length": 1}
    assert onnx_dims.parse("2 * (past length + seq.len) - 1") == {"past length": 2, "seq.len": 2, "": -1}
    assert onnx_dims.parse("s0*2") == {"s0": 2}
    for opaque in ("s0", "unk__12", "a * b", "a // 2", "(a + b", "a +"):
        assert onnx_dims.parse(opaque) is None, opaque


def test_expression_dims_are_computed_from_the_free_ones():
    (default, no_past), (small, small_no_past) = onnx_dims.Dims(DECODER).shape_sets()
    assert default == {"input_ids": (2, 16), "attention_mask": (2, 32), "past_key_values.0.key": (2, 2, 16, 16)}
    assert no_past["attention_mask"] == (2, 16) and no_past["past_key_values.0.key"] == (2, 2, 0, 16)
    assert small == {"input_ids": (1, 1), "attention_mask": (1, 2), "past_key_values.0.key": (1, 2, 1, 16)}
    # a name with an operator in it that is no dim of its own is one opaque name
    assert onnx_dims.Dims({"x": ["batch-size", 8]}).shape_sets()[0] == [{"x": (2, 8)}]


def test_given_shapes_solve_the_rest_or_are_refused():
    dims = onnx_dims.Dims(DECODER, {"attention_mask": (1, 40), "input_ids": (1, 8)})
    assert dims.shape_sets()[0][0]["past_key_values.0.key"] == (1, 2, 32, 16)
    only_mask = onnx_dims.Dims(DECODER, {"attention_mask": (1, 8)}).shape_sets()[0][0]
    assert only_mask["input_ids"] == (1, 8) and only_mask["past_key_values.0.key"] == (1, 2, 0, 16)
    with pytest.raises(ConfigError, match=r"attention_mask: dim 'past_sequence_length \+ sequence_length' is 4, but"):
        onnx_dims.Dims(DECODER, {"attention_mask": (1, 4), "input_ids": (1, 8)})
    with pytest.raises(ConfigError, match="unknown input 'ids'"):
        onnx_dims.Dims(DECODER, {"ids": (1, 8)})
    assert onnx_dims.Dims({"x": ["n", "n - 1"]}).shape_sets() == [[{"x": (2, 1)}], [{"x": (1, 0)}]]
    with pytest.raises(ConfigError, match="'n - 20' comes out negative at the default sizes"):
        onnx_dims.Dims({"x": ["n", "n - 20"]}).shape_sets()


GENAI = {"input_ids": ["batch_size", "sequence_length"], "attention_mask": ["batch_size", "total_sequence_length"],
         "past_key_values.0.key": ["batch_size", 2, "past_sequence_length", "kv_cache_dim"]}


def test_genai_dims_from_the_graph():
    """onnxruntime-genai's names: the head size the graph fixes (onnx/cache_dims.py) is bound, never zeroed
    with the past; the mask's own length is past + sequence, so --input-shape solves through it as through
    optimum's expression; without past inputs a mask length stays a free name."""
    (default, no_past), (small, _) = onnx_dims.Dims(GENAI, implied={"kv_cache_dim": 32}).shape_sets()
    assert default == {"input_ids": (2, 16), "attention_mask": (2, 32), "past_key_values.0.key": (2, 2, 16, 32)}
    assert no_past["attention_mask"] == (2, 16) and no_past["past_key_values.0.key"] == (2, 2, 0, 32)
    assert small["attention_mask"] == (1, 2) and small["past_key_values.0.key"] == (1, 2, 1, 32)
    given = onnx_dims.Dims(GENAI, {"attention_mask": (1, 40), "input_ids": (1, 8)}, implied={"kv_cache_dim": 32})
    assert given.shape_sets()[0][0]["past_key_values.0.key"] == (1, 2, 32, 32)
    assert onnx_dims.Dims(GENAI, {"past_key_values.0.key": (1, 2, 4, 64)}, implied={"kv_cache_dim": 32}
                          ).shape_sets()[0][0]["past_key_values.0.key"] == (1, 2, 4, 64)  # the user's word first
    no_cache = {k: v for k, v in GENAI.items() if "past" not in k}
    assert onnx_dims.Dims(no_cache).shape_sets()[0][0]["attention_mask"] == (2, 16)


@pytest.fixture(scope="module")
def decoders(tmp_path_factory) -> dict:
    """The tiny Llama decoder-with-past as optimum writes it (TorchScript exporter), the dynamo
    export with optimum's dim names, and the dynamo export with the exporter's own (`s53`)."""
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("decoders")
    decoder_with_past.export_torchscript(folder / "torchscript.onnx")
    exported = decoder_with_past.export_dynamo(folder / "exporter_dims.onnx")
    onnx.save(decoder_with_past.optimum_dims(exported), str(folder / "optimum_dims.onnx"))
    return {name: folder / f"{name}.onnx" for name in ("torchscript", "optimum_dims", "exporter_dims")}


@pytest.mark.parametrize("kind", ["torchscript", "optimum_dims", "exporter_dims"])
def test_decoder_with_past_rewrites_with_no_flag(decoders, kind, tmp_path):
    """Every symbolic dim at 16 made attention_mask shorter than past + sequence: onnxruntime refused
    the original ("Gather ... idx=32"). The mask's dim is now computed (`past_sequence_length +
    sequence_length`), or, for names that say nothing (`s53`), the past is tried empty."""
    path = decoders[kind]
    inputs = onnx_dims.declared(onnx.load(str(path), load_external_data=False))
    assert list(inputs) == decoder_with_past.names()[0]
    if kind != "exporter_dims":
        assert {d for dims in inputs.values() for d in dims if isinstance(d, str)} == decoder_with_past.OPTIMUM_DIMS
    report = rewrite_onnx(path, tmp_path / "out.onnx").report
    assert report["summary"]["sites_rewritten"] == 4
    assert [r["output"] for r in report["verification"]] == decoder_with_past.names()[1]
    assert all(r["ok"] for r in report["verification"]), report["verification"]
    default, small = report["verified_shapes"]
    past = default["past_key_values.0.key"][2]
    assert default["attention_mask"] == [2, past + 16] and small["input_ids"] == [1, 1]
    assert past == (0 if kind == "exporter_dims" else 16)


def test_decoder_hint_names_shapes_that_were_tried(decoders, tmp_path, capsys):
    """The old hint (--input-shape input_ids:1x128) failed like the default dims; it works now, and a
    refusal names the shapes it tried and the mask rule instead of an untried guess."""
    path = decoders["optimum_dims"]
    assert main(["rewrite", str(path), "-o", str(tmp_path / "a.onnx"), "--input-shape", "input_ids:1x128"]) == 0
    assert "attention_mask 1x144" in capsys.readouterr().out
    assert main(["rewrite", str(path), "-o", str(tmp_path / "c.onnx"), "--input-shape", "attention_mask:1x4",
                 "--input-shape", "input_ids:1x8"]) == 2
    assert "is 4, but the other shapes given make it 8" in capsys.readouterr().err
    with pytest.raises(ModelRunError) as refused:  # the mask's name (s53) says nothing; 8 < every past + sequence tried
        rewrite_onnx(decoders["exporter_dims"], tmp_path / "b.onnx", input_shapes={"attention_mask": (2, 8)})
    message = str(refused.value)
    assert "at the shapes tried: input_ids 2x16, attention_mask 2x8," in message and ", and again with " in message
    assert "attention_mask's length is the past length plus the sequence length" in message
    assert "1x128" not in message


def _model(path, body: list, width: str = "n") -> str:
    """y = f(x) over x [b, width], float32, opset 17."""
    graph = helper.make_graph(body, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", width])],
                              initializer=[helper.make_tensor("one", TensorProto.INT64, [1], [1]),
                                           helper.make_tensor("two", TensorProto.INT64, [1], [2]),
                                           helper.make_tensor("rows", TensorProto.INT64, [2], [-1, 16])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


DOUBLE = [helper.make_node("Add", ["x", "x"], ["y"])]
# 2x, plus 1 where the width is 1 (a broadcast that is only right at the default sizes): equal at 16
PLUS_ONE_AT_1 = [helper.make_node("Add", ["x", "x"], ["x2"]), helper.make_node("Shape", ["x"], ["s"]),
                 helper.make_node("Slice", ["s", "one", "two"], ["width"]),
                 helper.make_node("Equal", ["width", "one"], ["is1"]),
                 helper.make_node("Cast", ["is1"], ["add"], to=TensorProto.FLOAT),
                 helper.make_node("Add", ["x2", "add"], ["y"])]
# 2x through a Reshape to rows of 16: fails in onnxruntime when b * n is no multiple of 16
ROWS_OF_16 = [helper.make_node("Add", ["x", "x"], ["x2"]), helper.make_node("Reshape", ["x2", "rows"], ["r"]),
              helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["r", "s"], ["y"])]


def test_a_rewrite_wrong_only_at_size_1_is_caught(tmp_path):
    """The default dims (2x16) hide a result that is wrong, or a model that fails, at width 1: the second
    shape set (every free dim 1) catches both, and says at which shapes."""
    tol = verify.tolerance("preserve", False)
    original = _model(tmp_path / "o.onnx", DOUBLE)
    rows, verified, notes = ort_backend.compare_files(original, _model(tmp_path / "w.onnx", PLUS_ONE_AT_1), tol)
    assert verified == [{"x": (2, 16)}, {"x": (1, 1)}] and not notes
    (row,) = rows
    assert row["ok"] is False and row["at"] == "x 1x1" and row["max_abs"] == 1.0
    rows, _, _ = ort_backend.compare_files(original, _model(tmp_path / "f.onnx", ROWS_OF_16), tol)
    assert rows[-1]["ok"] is False and "fails where the original runs" in rows[-1]["error"] and rows[-1]["at"] == "x 1x1"
    rows, verified, _ = ort_backend.compare_files(original, original, tol)
    assert [r["ok"] for r in rows] == [True] and len(verified) == 2


def test_a_small_set_the_original_refuses_is_skipped_with_a_note(tmp_path):
    tol = verify.tolerance("preserve", False)
    original = _model(tmp_path / "o.onnx", ROWS_OF_16)
    rows, verified, notes = ort_backend.compare_files(original, original, tol)
    assert [r["ok"] for r in rows] == [True] and verified == [{"x": (2, 16)}]
    assert notes and notes[0].startswith("not verified at the small shapes (x 1x1): the original model fails there")
    static = _model(tmp_path / "s.onnx", DOUBLE, width=16)
    assert ort_backend.compare_files(static, static, tol)[1] == [{"x": (2, 16)}, {"x": (1, 16)}]


class _Strided(torch.nn.Module):
    """An audio-like front end: two strided convolutions need more than 16 samples, then residual layers."""

    def __init__(self):
        super().__init__()
        self.convs = torch.nn.Sequential(torch.nn.Conv1d(1, 8, 10, 5), torch.nn.GELU(), torch.nn.Conv1d(8, 8, 10, 5))
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        h = self.convs(x.unsqueeze(1)).transpose(1, 2)
        for layer in self.layers:
            h = h + layer(h)
        return h


def test_exported_files_are_verified_at_their_example_sizes(tmp_path):
    """16 samples are too few for this conv stack: onnxruntime refused the default set, so `compile` of our
    own export failed unless the user found --input-shape. The export records the example's sizes."""
    from attnres_compile import AttnResConfig
    from attnres_compile.onnx.pipeline import export_onnx

    torch.manual_seed(0)
    export_onnx(_Strided().eval(), (torch.randn(2, 400),), tmp_path / "a.onnx", AttnResConfig(variant="full"))
    sess = ort_backend.session(tmp_path / "a.onnx")
    assert ort_backend.input_shapes(sess) == {"x": (2, 400)}
    assert ort_backend.input_shapes(sess, {"x": (3, 200)}) == {"x": (3, 200)}  # --input-shape still first
    assert "refused" not in ort_backend.run_sets(tmp_path / "a.onnx")[0]


@pytest.mark.parametrize("value", ['{"n": 400', '[400]', '{"n": "400"}', '{"n": 0}', '{"n": 1e9}', '{"n": true}', "[" * 5000])
def test_malformed_example_sizes_are_ignored(value):
    assert onnx_dims.examples({onnx_dims.EXAMPLE_DIMS: value}) == {}
    assert onnx_dims.Dims({"x": ["b", "n"]}, examples=onnx_dims.examples({onnx_dims.EXAMPLE_DIMS: value})).shape_sets()[0][0] == {"x": (2, 16)}


def _cache_reader(path, op: str) -> str:
    """x [b, s, 64] -> a com.microsoft attention op with 2 heads reading a past whose head dim is the name `head`:
    MultiHeadAttention (q, k, v from MatMuls; past [b, 2, past, head]) or Attention (packed weights; past
    [2, b, 2, past, head], unidirectional)."""
    from onnx import numpy_helper

    rng = np.random.default_rng(0)
    hidden = 64
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", hidden])
    if op == "MultiHeadAttention":
        inits = [numpy_helper.from_array(rng.standard_normal((hidden, hidden)).astype(np.float32), n) for n in "qkv"]
        pasts = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", 2, "past", "head"]) for n in ("past_key", "past_value")]
        nodes = [helper.make_node("MatMul", ["x", n], [f"{n}_out"]) for n in "qkv"]
        nodes.append(helper.make_node("MultiHeadAttention", ["q_out", "k_out", "v_out", "", "", "", "past_key", "past_value"],
                                      ["y", "present_key", "present_value"], domain="com.microsoft", num_heads=2))
        outputs = ["y", "present_key", "present_value"]
    else:
        inits = [numpy_helper.from_array(rng.standard_normal((hidden, 3 * hidden)).astype(np.float32), "w"),
                 numpy_helper.from_array(np.zeros(3 * hidden, np.float32), "bias")]
        pasts = [helper.make_tensor_value_info("past", TensorProto.FLOAT, [2, "b", 2, "past", "head"])]
        nodes = [helper.make_node("Attention", ["x", "w", "bias", "", "past"], ["y", "present"], domain="com.microsoft",
                                  num_heads=2, unidirectional=1)]
        outputs = ["y", "present"]
    graph = helper.make_graph(nodes, "g", [x, *pasts], [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                                                        for o in outputs], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]),
              str(path))
    return str(path)


@pytest.mark.parametrize("op", ["MultiHeadAttention", "Attention"])
def test_cache_head_size_from_the_attention_op(tmp_path, op):
    """The past's head dim gets the size the op implies (64 features over 2 heads: 32); onnxruntime runs the
    original at the shapes verification picks (it refuses the free 16)."""
    from attnres_compile.onnx import cache_dims as onnx_cache_dims

    path = _cache_reader(tmp_path / f"{op}.onnx", op)
    implied = onnx_cache_dims.head_sizes(onnx.load(path))
    assert {k: v.size for k, v in implied.items()} == {"head": 32} and op in implied["head"].why
    runs, notes = ort_backend.verification_runs(path, None, None)
    assert runs and all(shapes[-1] == 32 for name, shapes in runs[0]["shapes"].items() if "past" in name)
    assert notes[0].startswith(f"verified with head = 32: the head size {op}")
    with pytest.raises(ModelRunError):
        ort_backend.verification_runs(path, None, {n: (2, 2, 16, 16) if op != "Attention" else (2, 2, 2, 16, 16)
                                                   for n in ("past_key", "past_value", "past") if n in runs[0]["shapes"]})
