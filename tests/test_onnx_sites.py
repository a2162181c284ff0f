"""The ONNX site form: the two-phase pair (DepthAttentionPartial + DepthAttentionMerge) on both paths,
with trained (non-zero) pseudo-queries; linear file growth with depth; refusal of malformed site nodes.

Both paths to ONNX (the ONNX-file rewrite and the PyTorch export) must write the same form; the
reference is the fx rewrite of the same model with the same random queries, run in torch.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import attnres_compile as ac
from attnres_compile.onnx import runtime as ort_backend
from attnres_compile.core.errors import CorruptModelError
from attnres_compile.onnx.pipeline import inspect_onnx, rewrite_onnx
from attnres_compile.onnx import export as onnx_export
from attnres_compile.core import verify
from attnres_compile.onnx.function import DOMAIN, MERGE, OP_TYPE, PARTIAL, attach_functions, merge_node, partial_node
from attnres_compile.core.two_phase import MAX_GROUP
from attnres_compile.onnx.two_phase import sites
from attnres_compile.onnx.site_check import check_sites
from attnres_compile.onnx.view import value_types
from samples import models

CONFIGS = {"full": ac.AttnResConfig(), "block": ac.AttnResConfig(variant="block", num_blocks=2)}


def _form(model: onnx.ModelProto) -> list[tuple]:
    """The attnres nodes as (op type, input count, attributes): the structure both paths must share."""
    return [(n.op_type, len(n.input), sorted((a.name, helper.get_attribute_value(a)) for a in n.attribute))
            for n in model.graph.node if n.domain == DOMAIN]


def _run(model: onnx.ModelProto, tokens: torch.Tensor, folder: Path, name: str) -> np.ndarray:
    path = folder / f"{name}.onnx"
    onnx.save(model, str(path))
    onnx.checker.check_model(str(path), full_check=True)
    sess = ort_backend.session(path)
    return next(iter(ort_backend.run(sess, {sess.get_inputs()[0].name: tokens.numpy()}).values()))


@pytest.mark.parametrize("variant", CONFIGS)
def test_two_phase_form_is_exact_with_trained_queries(tmp_path, variant):
    """8 sites (Full: groups of 3, 3 and 2; Block: 2 blocks of 4), random queries: ONNX rewrite and PyTorch
    export write the same Partial/Merge form, and both match the fx rewrite in torch within the verifier's
    float32 tolerance (the two-phase split reassociates the softmax sums)."""
    model, args = models.gpt_factory()
    config = CONFIGS[variant]
    gm = ac.rewrite(model, args, config, verify_outputs=False).graph_module
    with torch.no_grad():
        for p in gm.attnres.parameters():
            p.normal_(0.0, 2.0 / math.sqrt(p.numel()))  # logits of a few units: far from uniform weights
    queries = {k: v.numpy() for k, v in gm.state_dict().items() if k.startswith("attnres.")}
    src = tmp_path / "gpt.onnx"
    torch.onnx.export(model, args, str(src), dynamo=False, opset_version=17, input_names=["idx"],
                      dynamic_axes={"idx": {0: "batch", 1: "seq"}})
    rewrite_onnx(src, tmp_path / "rewritten.onnx", config, verify_outputs=False)
    rewritten = onnx.load(str(tmp_path / "rewritten.onnx"))
    for init in rewritten.graph.initializer:
        if init.name in queries:
            init.CopyFrom(numpy_helper.from_array(queries[init.name], init.name))
    exported = onnx_export.export(gm, args)
    assert _form(rewritten) == _form(exported)
    found = sites(rewritten.graph)
    assert [len(s.sources) for s in found] == [len(s.sources) for s in sites(exported.graph)]
    # Full: the last group, two sites over a short history, stays two DepthAttention nodes
    assert [s.node.op_type for s in found] == ([MERGE] * 6 + [OP_TYPE] * 2 if variant == "full" else [MERGE] * 8)
    assert sum(n.op_type == PARTIAL for n in rewritten.graph.node) == 2
    tokens = torch.randint(0, 96, tuple(args[0].shape), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = gm(tokens)
    tol = verify.tolerance("preserve", False)
    for name, proto in (("rewritten", rewritten), ("exported", exported)):
        actual = torch.from_numpy(_run(proto, tokens, tmp_path, name))
        rows = verify.compare(expected, actual, tol)
        assert rows and all(r["ok"] for r in rows), (name, rows)


def test_full_rewrite_grows_linearly_with_depth(tmp_path):
    """A Full rewrite used to define one function per site with ~9 nodes per source (O(L^2) nodes:
    39 MB at 500 links); the two-phase form keeps function definitions and input references O(L)."""
    stats = {}
    for links in (64, 256):
        out = tmp_path / f"full{links}.onnx"
        rewrite_onnx(models.onnx_chain(tmp_path / f"chain{links}.onnx", links), out, verify_outputs=False)
        model = onnx.load(str(out))
        stats[links] = (out.stat().st_size - (tmp_path / f"chain{links}.onnx").stat().st_size,
                        sum(len(f.node) for f in model.functions),
                        sum(len(n.input) for n in model.graph.node if n.domain == DOMAIN))
        assert len(sites(model.graph)) == links
    grown = stats[256][0] / stats[64][0]
    print(f"bytes x{grown:.2f} for 4x the links; function nodes, attnres input references: {stats}")
    assert grown < 5  # linear: 4x (quadratic would be 16x)
    for links, (_, function_nodes, references) in stats.items():
        # one Merge function per extra count (at most MAX_GROUP), each site naming at most MAX_GROUP extras
        assert function_nodes < 40 * MAX_GROUP**2 // 2 and references <= links * (MAX_GROUP + 3)


def test_onnxruntime_reads_a_shared_source_once_per_group_for_its_logits(tmp_path):
    """Where a source is a term of several sites, the parts of its logits that do not depend on the
    site are computed once (onnxruntime's common-subexpression elimination over the inlined
    bodies): its mean square at most twice (among the Merges, and in the Partial that stacks it),
    and under a Merge its dots with all of the group's queries in one MatMul per (source, group),
    instead of an RMSNorm pass per (source, site)."""
    out = tmp_path / "full.onnx"
    rewrite_onnx(models.onnx_chain(tmp_path / "chain.onnx", 16), out, verify_outputs=False)
    model = onnx.load(str(out))
    rng = np.random.default_rng(0)
    found = sites(model.graph)
    for init in model.graph.initializer:  # trained queries: no two sites' columns alike
        if init.name in {s.query for s in found}:
            init.CopyFrom(numpy_helper.from_array(rng.standard_normal(list(init.dims)).astype(np.float32), init.name))
    onnx.save(model, str(out))
    one_pass = [s for s in found if s.node.op_type == OP_TYPE]
    groups: dict[str, set] = {}  # a Partial's columns output -> the extras of its Merges with more than one
    for s in found:
        if s.node.op_type == MERGE and len(s.node.input) - 4 > 1:
            groups.setdefault(s.node.input[2], set()).update(s.node.input[3:-1])
    pairs = sum(len(s.node.input) - 1 for s in one_pass)
    per_group = sum(len(extras) for extras in groups.values())
    per_site = sum(len(s.node.input) - 4 for s in found if s.node.op_type == MERGE and s.node.input[2] in groups)
    assert len(groups) >= 2 and per_site > per_group
    options = ort_backend.ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.graph_optimization_level = ort_backend.ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    ort_backend.ort.InferenceSession(str(out), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(str(tmp_path / "optimized.onnx"))
    weights = {i.name for i in model.graph.initializer}
    columns = {i.name for i in optimized.graph.initializer if len(i.dims) == 2 and i.dims[0] == 8 and i.name not in weights}
    logits = [n for n in optimized.graph.node if n.op_type == "MatMul" and n.input[1] in columns]
    assert len(logits) == pairs + per_group + sum(n.op_type == PARTIAL for n in model.graph.node)  # + each Partial's own
    terms = {t for s in found for t in s.sources}  # an entry's RMS: once as an extra, once in the next Partial
    assert sum(n.op_type == "ReduceMean" for n in optimized.graph.node) <= 2 * len(terms) < pairs + per_site


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory) -> onnx.ModelProto:
    """A Block rewrite of a 12-link chain: Partials (one carrying the other's history) and Merges."""
    folder = tmp_path_factory.mktemp("sites")
    out = folder / "block.onnx"
    rewrite_onnx(models.onnx_chain(folder / "chain.onnx", 12), out, ac.AttnResConfig(variant="block", num_blocks=3),
                 verify_outputs=False)
    return onnx.load(str(out))


def _node(model, op_type, index=0):
    return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == op_type][index]


def _set(node, name, value):
    next(a for a in node.attribute if a.name == name).CopyFrom(helper.make_attribute(name, value))


def _mutations():
    def attr(op, name, value):
        return lambda m: _set(_node(m, op), name, value)

    def drop_input(m):
        node = _node(m, MERGE)
        del node.input[3]

    def rewire(m):  # a Merge reading another Partial's acc with its own lse
        merge, second = _node(m, MERGE), _node(m, PARTIAL, 1)
        merge.input[1] = second.output[3]

    def collide(m):
        m.functions.append(helper.make_function(DOMAIN, OP_TYPE, ["x"], ["y"], [helper.make_node("Identity", ["x"], ["y"])],
                                                [helper.make_opsetid("", 17)]))

    def edit_body(m):
        fn = next(f for f in m.functions if f.name == MERGE)
        fn.node[-1].op_type = "Identity"
        del fn.node[-1].input[1:]

    def unknown_op(m):
        _node(m, MERGE).op_type = "DepthAttentionFast"

    def int_query(m):
        name = _node(m, MERGE).input[-1]
        init = next(i for i in m.graph.initializer if i.name == name)
        init.CopyFrom(numpy_helper.from_array(np.zeros(8, np.int64), name))

    def in_subgraph(m):
        body = helper.make_graph([_node(m, MERGE)], "then", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
        m.graph.node.append(helper.make_node("If", ["c"], ["z"], then_branch=body, else_branch=body))

    def no_function(m):
        keep = [f for f in m.functions if f.name != PARTIAL]
        m.ClearField("functions")
        m.functions.extend(keep)

    return {
        "eps -1": (attr(MERGE, "eps", -1.0), "eps is -1.0"),
        "scale nan": (attr(MERGE, "scale", float("nan")), "scale is nan"),
        "index out of range": (attr(MERGE, "index", 7), "index 7 is outside"),
        "axis 1": (attr(PARTIAL, "axis", 1), "axis is 1"),
        "carry 2": (attr(PARTIAL, "carry", 2), "expected carry 0 or 1"),
        "float index": (attr(MERGE, "index", 0.5), "attribute index is not a plain int"),
        "missing extra": (drop_input, "4 inputs, expected lse, acc, columns"),
        "rewired state": (rewire, "not the lse, acc and columns outputs of one earlier Partial"),
        "user function under our name": (collide, "defines its own function attnres.DepthAttention"),
        "edited body": (edit_body, "differs from the one attnres-compile writes"),
        "unknown op": (unknown_op, "has no operator 'DepthAttentionFast'"),
        "int64 query": (int_query, "is not a float vector"),
        "inside a subgraph": (in_subgraph, "inside a subgraph"),
        "missing function": (no_function, "without their function definition"),
    }


MUTATIONS = _mutations()


@pytest.mark.parametrize("case", MUTATIONS)
def test_malformed_site_nodes_are_refused(rewritten, case):
    assert check_sites(rewritten) == 12
    model = onnx.ModelProto()
    model.CopyFrom(rewritten)
    mutate, message = MUTATIONS[case]
    mutate(model)
    with pytest.raises(CorruptModelError, match=message) as err:
        check_sites(model, value_types(model.graph))
    assert "\n" not in str(err.value) and err.value.exit_code == 9


def test_a_spoofed_site_stops_inspect_in_one_line(rewritten, tmp_path):
    model = onnx.ModelProto()
    model.CopyFrom(rewritten)
    assert inspect_onnx_ok(model, tmp_path)
    _set(_node(model, MERGE, 3), "eps", 0.0)
    onnx.save(model, str(tmp_path / "spoofed.onnx"))
    with pytest.raises(CorruptModelError, match="eps is 0.0, must be positive"):
        inspect_onnx(tmp_path / "spoofed.onnx")


def inspect_onnx_ok(model: onnx.ModelProto, folder: Path) -> bool:
    """The untouched rewrite counts as rewritten: one site per Merge, nothing left to rewrite."""
    onnx.save(model, str(folder / "ok.onnx"))
    report = inspect_onnx(folder / "ok.onnx")
    return report["summary"]["existing_sites"] == 12 and not [c for c in report["chains"] if c["status"] == "rewritten"]


def _block_group(queries: np.ndarray, folder: Path) -> Path:
    """One Block group as onnxruntime runs it: a Partial carrying a stacked history (hist, rms) and
    adding `new`, then one Merge per query over its own partial sum x_i (scale 4)."""
    count, width = queries.shape
    names = [f"q{i}" for i in range(count)]
    nodes = [partial_node(["hist", "rms"], ["new"], names, ["history", "norms", "lse", "acc", "columns"], eps=1e-6,
                          name="partial")]
    nodes += [merge_node("lse", "acc", "columns", [f"x{i}"], names[i], f"out{i}", index=i, eps=1e-6, scale=4.0,
                         name=f"merge{i}") for i in range(count)]
    rows = ["batch", "seq"]
    rows_of = {"hist": [*rows, 2, width], "rms": [*rows, 2, 1], "new": [*rows, width],
               **{f"x{i}": [*rows, width] for i in range(count)}}
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n, shape in rows_of.items()]
    outputs = [helper.make_tensor_value_info(f"out{i}", TensorProto.FLOAT, [*rows, width]) for i in range(count)]
    graph = helper.make_graph(nodes, "group", inputs, outputs,
                              [numpy_helper.from_array(q, n) for q, n in zip(queries, names)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])
    attach_functions(model)
    onnx.save(model, str(folder / "group.onnx"))
    return folder / "group.onnx"


def test_a_block_site_runs_in_few_onnxruntime_nodes(tmp_path):
    """At small widths and one row (decode) a site's cost is mostly onnxruntime's per-node cost
    (benchmarks/runs/2026-12-06-ort-block/): a Block group of three sites (one Partial carrying a
    history, three Merges) runs in 54 nodes after onnxruntime's fusions, 18 a site: the Partial 21
    (its two Splits those of the Merges' Gathers), each Merge 11 (its query's RMSNorm pattern one
    SimplifiedLayerNormalization)."""
    options = ort_backend.ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    queries = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    ort_backend.ort.InferenceSession(str(_block_group(queries, tmp_path)), options, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
    for _ in range(3):  # each output's float-to-float CastLike: onnxruntime keeps a node that writes a graph output
        ops.remove("Cast")
    assert len(ops) == 54, sorted(ops)
    assert ops.count("SimplifiedLayerNormalization") == 3 and ops.count("Split") == 2 and ops.count("Squeeze") == 6


def test_a_block_group_matches_depth_attention_at_large_logits(tmp_path):
    """The group's outputs against depth attention in float64 over (hist, new, x_i), with logits of
    hundreds (the softmax far from uniform, exp overflowing without its shift), at a tolerance scaled
    to the outputs."""
    rng = np.random.default_rng(3)
    queries = (rng.standard_normal((3, 8)) * 60).astype(np.float32)
    hist, new = rng.standard_normal((2, 5, 2, 8)).astype(np.float32), rng.standard_normal((2, 5, 8)).astype(np.float32)
    xs = rng.standard_normal((3, 2, 5, 8)).astype(np.float32)
    sess = ort_backend.session(_block_group(queries, tmp_path))
    feeds = {"hist": hist, "rms": np.sqrt((hist * hist).mean(-1, keepdims=True) + 1e-6), "new": new,
             **{f"x{i}": x for i, x in enumerate(xs)}}
    outs = sess.run(None, feeds)
    for i, (x, out) in enumerate(zip(xs, outs)):
        sources = np.concatenate([hist, new[:, :, None], x[:, :, None]], axis=2).astype(np.float64)  # [2, 5, 4, 8]
        z = (sources / np.sqrt((sources ** 2).mean(-1, keepdims=True) + 1e-6)) @ queries[i].astype(np.float64)
        assert np.abs(z).max() > 100
        p = np.exp(z - z.max(-1, keepdims=True))
        expected = 4.0 * ((p / p.sum(-1, keepdims=True))[..., None] * sources).sum(-2)
        assert np.abs(out - expected).max() <= 1e-5 * np.abs(expected).max(), i
