"""Before -> Expected for each ONNX pass (issue 61): a tiny model built with onnx.helper, the pass applied,
the expected model built by hand (the site nodes with onnx/function.py's helpers), compared structurally
(`structure`) with the pass's count, then the numbers in onnxruntime.

Passes: onnx/passes.py `UnfuseSkipNorms`, `RewriteSites` (Full, Block, a parallel link, a skip that
changes layout), `FuseNorms`, `GroupSites`, `AttachFunctions`; onnx/exact_sigmoid.py `exact_sigmoids`.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import onnxruntime.tools.symbolic_shape_infer  # imported here once: the views' shape inference forks from this process
import pytest
from onnx import TensorProto, helper, numpy_helper

from attnres_compile.core.chain_analysis import analyze
from attnres_compile.core.config import AttnResConfig
from attnres_compile.onnx import function
from attnres_compile.onnx.exact_sigmoid import exact_sigmoids
from attnres_compile.onnx.function import merge_node, pair_node, partial_node, site_node
from attnres_compile.onnx.passes import (
    AttachFunctions,
    FuseNorms,
    GroupSites,
    RewriteSites,
    UnfuseSkipNorms,
)
from attnres_compile.onnx.view import view_from_onnx

D = 4
SHAPE = [2, 3, D]
EPS = 1e-6
FLOAT = TensorProto.FLOAT
OPSET = 18


# ---- the structural comparison ------------------------------------------------------------------------


def _attribute(a: onnx.AttributeProto):
    value = helper.get_attribute_value(a)
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, onnx.TensorProto):  # a Constant's value: its type and numbers, not its name
        return value.data_type, tuple(value.dims), numpy_helper.to_array(value).tolist()
    return value


def structure(model: onnx.ModelProto, keep: set[str]) -> dict:
    """`model.graph` in a canonical form, whatever its node names and order: the nodes in post-order from
    the graph outputs (producers first, in input order), then the nodes no output depends on, in file
    order; each node (domain, op_type, overload, attributes, inputs, outputs) with every value name not
    in `keep` (the values the pass made) replaced by its order of appearance (`%0`, `%1`, ...). Graph
    inputs, outputs and initializers keep their names; initializers compare by type, shape and numbers."""
    graph = model.graph
    keep = keep | {i.name for i in graph.initializer} | {i.name for i in graph.input} | {o.name for o in graph.output}
    producer = {o: n for n in graph.node for o in n.output if o}
    order: list[onnx.NodeProto] = []
    seen: set[int] = set()

    def visit(node: onnx.NodeProto | None) -> None:
        if node is None or id(node) in seen:
            return
        seen.add(id(node))
        for name in node.input:
            visit(producer.get(name))
        order.append(node)

    for out in graph.output:
        visit(producer.get(out.name))
    for node in graph.node:
        visit(node)
    names: dict[str, str] = {}

    def name(value: str) -> str:
        if not value or value in keep:
            return value
        return names.setdefault(value, f"%{len(names)}")

    nodes = [(n.domain, n.op_type, n.overload, sorted((a.name, _attribute(a)) for a in n.attribute),
              [name(i) for i in n.input], [name(o) for o in n.output]) for n in order]
    initializers = {i.name: (i.data_type, tuple(i.dims), numpy_helper.to_array(i).tolist()) for i in graph.initializer}
    return {"inputs": [i.name for i in graph.input], "outputs": [o.name for o in graph.output],
            "initializers": initializers, "nodes": nodes}


def values(model: onnx.ModelProto) -> set[str]:
    """Every value name of `model`'s graph: what a pass found there, and keeps the name of."""
    graph = model.graph
    return ({o for n in graph.node for o in n.output} | {i.name for i in graph.initializer}
            | {i.name for i in graph.input})


def assert_same_graph(got: onnx.ModelProto, expected: onnx.ModelProto, before: onnx.ModelProto) -> None:
    keep = values(before)
    got_s, expected_s = structure(got, keep), structure(expected, keep)
    for key in ("inputs", "outputs", "initializers"):
        assert got_s[key] == expected_s[key], key
    assert got_s["nodes"] == expected_s["nodes"], "\n".join(
        ["got:", *map(str, got_s["nodes"]), "expected:", *map(str, expected_s["nodes"])])


# ---- building and running models ------------------------------------------------------------------------


def node(op_type: str, inputs: list[str], outputs: list[str] | str, **attrs) -> onnx.NodeProto:
    outputs = [outputs] if isinstance(outputs, str) else outputs
    return helper.make_node(op_type, inputs, outputs, name=f"{op_type}_{outputs[0]}", **attrs)


def tensor(name: str, array) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array), name)


def weights(*names: str, seed: int = 0) -> list[onnx.TensorProto]:
    rng = np.random.default_rng(seed)
    return [tensor(n, rng.standard_normal((D, D)).astype(np.float32) / 2) for n in names]


def vectors(*names: str, seed: int = 1, low: float = -1.0, high: float = 1.0) -> list[onnx.TensorProto]:
    rng = np.random.default_rng(seed)
    return [tensor(n, rng.uniform(low, high, D).astype(np.float32)) for n in names]


def zeros(*names: str) -> list[onnx.TensorProto]:
    """Pseudo-queries as RewriteSites makes them: zero float32 [D] initializers."""
    return [tensor(n, np.zeros(D, np.float32)) for n in names]


def model(nodes, inputs, outputs, initializers=(), opset: int = OPSET, attnres: bool = False,
          elem: int = FLOAT, out_shape=SHAPE) -> onnx.ModelProto:
    """A model of `nodes` whose inputs are [2, 3, D] tensors of type `elem`, its outputs `out_shape` ones."""
    graph = helper.make_graph(list(nodes), "before", [helper.make_tensor_value_info(i, elem, SHAPE) for i in inputs],
                              [helper.make_tensor_value_info(o, elem, out_shape) for o in outputs], list(initializers))
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", 1)] if not attnres else
                                                 [helper.make_opsetid(function.DOMAIN, function.DOMAIN_VERSION)])
    return helper.make_model(graph, opset_imports=opsets, ir_version=9)


def copy(m: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(m)
    return out


X = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32)


def finalized(m: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `m` whose attnres nodes have their functions, as a model the pipeline writes."""
    m = copy(m)
    function.attach_functions(m)
    return m


def run(m: onnx.ModelProto, **feeds) -> list[np.ndarray]:
    """`m`'s outputs in onnxruntime (its attnres nodes given their functions, on a copy)."""
    m = finalized(m)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds or {"x": X})


def assert_same_numbers(a: onnx.ModelProto, b: onnx.ModelProto, rtol=1e-5, atol=1e-6, **feeds) -> None:
    for got, expected in zip(run(a, **feeds), run(b, **feeds), strict=True):
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)


# ---- UnfuseSkipNorms ------------------------------------------------------------------------------------


def skip_norm(simplified: bool, opset: int = 17, statistics: bool = False) -> onnx.ModelProto:
    """onnxruntime's fused residual norm: s = x + skip (+ bias), y = norm(s); s read by the next block."""
    if simplified:
        fused = helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"], ["y", "", "", "s"],
                                 name="skip_norm", domain="com.microsoft", epsilon=1e-5)
    else:
        fused = helper.make_node("SkipLayerNormalization", ["x", "skip", "gamma", "beta", "bias"],
                                 ["y", "mean" if statistics else "", "", "s"], name="skip_norm", domain="com.microsoft")
    outputs = ["y", "s"] + (["mean"] if statistics else [])
    return model([fused], ["x", "skip"], outputs, norm_params(simplified), opset=opset)


def norm_params(simplified: bool) -> list[onnx.TensorProto]:
    return vectors(*(["gamma"] if simplified else ["gamma", "beta", "bias"]), low=0.5, high=1.5)


def unfused_norm(simplified: bool, opset: int = 17) -> onnx.ModelProto:
    """The bias added to x (where the MatMul's bias was), then the residual Add, then the norm at
    axis -1 with float statistics: LayerNormalization with onnxruntime's default epsilon 1e-12, or the
    RMS norm of the opset (RMSNormalization from opset 23 on, else SimplifiedLayerNormalization)."""
    if simplified:
        norm = "RMSNormalization" if opset >= 23 else "SimplifiedLayerNormalization"
        nodes = [node("Add", ["x", "skip"], "s"),
                 node(norm, ["s", "gamma"], "y", axis=-1, epsilon=1e-5, stash_type=1)]
    else:
        nodes = [node("Add", ["x", "bias"], "biased"), node("Add", ["biased", "skip"], "s"),
                 node("LayerNormalization", ["s", "gamma", "beta"], "y", axis=-1, epsilon=1e-12, stash_type=1)]
    return model(nodes, ["x", "skip"], ["y", "s"], norm_params(simplified), opset=opset)


@pytest.mark.parametrize("simplified,opset", [(False, 17), (True, 17), (True, 23)])
def test_unfuse_skip_norms(simplified, opset):
    before = skip_norm(simplified, opset)
    m = copy(before)
    unfuse = UnfuseSkipNorms()
    result = unfuse(m)
    assert result.count == 1 and result.model is m
    op = "SkipSimplifiedLayerNormalization" if simplified else "SkipLayerNormalization"
    assert unfuse.unfused.counts == {op: 1} and not unfuse.unfused.kept
    expected = unfused_norm(simplified, opset)
    assert_same_graph(m, expected, before)
    assert_same_numbers(expected, before, x=X, skip=X[::-1].copy())


def test_unfuse_skip_norms_keeps_a_node_whose_statistics_are_read():
    before = skip_norm(False, statistics=True)
    m = copy(before)
    unfuse = UnfuseSkipNorms()
    assert unfuse(m).count == 0 and m == before
    assert unfuse.unfused.kept == [("skip_norm", "its mean or inv_std_var output is used (training statistics)")]


# ---- RewriteSites ---------------------------------------------------------------------------------------


def chain(links: int) -> onnx.ModelProto:
    """h_k = h_(k-1) + MatMul(h_(k-1), w_k), h_0 = x: `links` residual links, h_links the output."""
    nodes, h = [], "x"
    for k in range(1, links + 1):
        nodes += [node("MatMul", [h, f"w{k}"], f"b{k}"), node("Add", [h, f"b{k}"], f"h{k}")]
        h = f"h{k}"
    return model(nodes, ["x"], [h], weights(*(f"w{k}" for k in range(1, links + 1))))


def rewrite(m: onnx.ModelProto, config: AttnResConfig):
    """RewriteSites with the plan chain analysis makes of `m`'s view; its result and the pass."""
    view = view_from_onnx(m)
    rewrite_sites = RewriteSites(analyze(view, config), config, view)
    return rewrite_sites(m), rewrite_sites


def site(inputs: list[str], k: int, output: str, chain: int = 0) -> onnx.NodeProto:
    query = f"attnres.chain{chain}.site{k}"
    return site_node(inputs, query, output, eps=EPS, scale=len(inputs), axis=-1, rank=3)


def identity_on_skip() -> onnx.ModelProto:
    """chain(2) with an Identity on the second link's skip (value-preserving: the chain goes through it)."""
    m = chain(2)
    nodes = list(m.graph.node)
    nodes[3].input[0] = "k"
    m.graph.ClearField("node")
    m.graph.node.extend([*nodes[:2], node("Identity", ["h1"], "k"), *nodes[2:]])
    return m


@pytest.mark.parametrize("before", [chain(2), identity_on_skip()], ids=["plain", "identity_on_skip"])
def test_rewrite_sites_full(before):
    """Each h_k becomes one DepthAttention over x and the branches so far, under h_k's own name (its
    readers read it unchanged), with a zero query `attnres.chain0.site<k>`; the Adds go, and with them the
    ops on the skip path they leave unread (the Identity)."""
    m = copy(before)
    result, rewrite_sites = rewrite(m, AttnResConfig())
    assert result.count == 2 and [s.param for s in rewrite_sites.sites] == ["attnres.chain0.site1",
                                                                             "attnres.chain0.site2"]
    expected = model([node("MatMul", ["x", "w1"], "b1"), site(["x", "b1"], 1, "h1"),
                      node("MatMul", ["h1", "w2"], "b2"), site(["x", "b1", "b2"], 2, "h2")],
                     ["x"], ["h2"], weights("w1", "w2") + zeros("attnres.chain0.site1", "attnres.chain0.site2"))
    assert_same_graph(m, expected, before)
    assert_same_numbers(expected, before)


def test_rewrite_sites_block():
    """Blocks of 2 branches: the block b1 + b2 is one Add, read by both later sites."""
    before = chain(3)
    m = copy(before)
    assert rewrite(m, AttnResConfig(variant="block", block_size=2))[0].count == 3
    expected = model([node("MatMul", ["x", "w1"], "b1"), site(["x", "b1"], 1, "h1"),
                      node("MatMul", ["h1", "w2"], "b2"), node("Add", ["b1", "b2"], "block"),
                      site(["x", "block"], 2, "h2"),
                      node("MatMul", ["h2", "w3"], "b3"), site(["x", "block", "b3"], 3, "h3")],
                     ["x"], ["h3"], weights("w1", "w2", "w3") + zeros(*(f"attnres.chain0.site{k}" for k in (1, 2, 3))))
    assert_same_graph(m, expected, before)
    assert_same_numbers(expected, before)


def test_rewrite_sites_parallel_link():
    """h1 = x + attn + mlp (GPT-J's parallel block) is one site over both branches."""
    before = model([node("MatMul", ["x", "w1"], "a"), node("MatMul", ["x", "w2"], "m"),
                    node("Add", ["x", "a"], "xa"), node("Add", ["xa", "m"], "h1"),
                    node("MatMul", ["h1", "w3"], "b"), node("Add", ["h1", "b"], "h2")],
                   ["x"], ["h2"], weights("w1", "w2", "w3"))
    m = copy(before)
    assert rewrite(m, AttnResConfig())[0].count == 2
    expected = model([node("MatMul", ["x", "w1"], "a"), node("MatMul", ["x", "w2"], "m"),
                      site(["x", "a", "m"], 1, "h1"),
                      node("MatMul", ["h1", "w3"], "b"), site(["x", "a", "m", "b"], 2, "h2")],
                     ["x"], ["h2"], weights("w1", "w2", "w3") + zeros("attnres.chain0.site1", "attnres.chain0.site2"))
    assert_same_graph(m, expected, before)
    assert_same_numbers(expected, before)


def test_rewrite_sites_skip_that_changes_layout():
    """The stream viewed as [6, D] between the links (HF OPT): the second site's earlier sources are
    reshaped to its layout, Reshape(source, Shape(its branch)), the Shape taken once."""
    flat = [tensor("flat", np.array([-1, D], np.int64))]
    before = model([node("MatMul", ["x", "w1"], "b1"), node("Add", ["x", "b1"], "h1"),
                    node("Reshape", ["h1", "flat"], "v"),
                    node("MatMul", ["v", "w2"], "b2"), node("Add", ["v", "b2"], "h2")],
                   ["x"], ["h2"], weights("w1", "w2") + flat, out_shape=[6, D])
    m = copy(before)
    assert rewrite(m, AttnResConfig())[0].count == 2
    expected = model([node("MatMul", ["x", "w1"], "b1"), site(["x", "b1"], 1, "h1"),
                      node("Reshape", ["h1", "flat"], "v"), node("MatMul", ["v", "w2"], "b2"),
                      node("Shape", ["b2"], "b2_shape"),
                      node("Reshape", ["x", "b2_shape"], "x_flat"), node("Reshape", ["b1", "b2_shape"], "b1_flat"),
                      site(["x_flat", "b1_flat", "b2"], 2, "h2")],
                     ["x"], ["h2"], weights("w1", "w2") + flat + zeros("attnres.chain0.site1", "attnres.chain0.site2"),
                     out_shape=[6, D])
    assert_same_graph(m, expected, before)
    assert_same_numbers(expected, before)


def test_rewrite_sites_leaves_a_short_chain():
    before = chain(2)
    m = copy(before)
    assert rewrite(m, AttnResConfig(min_chain=3))[0].count == 0 and m == before


# ---- FuseNorms ------------------------------------------------------------------------------------------


def norm_nodes(form: str, x: str, out: str) -> list[onnx.NodeProto]:
    """A norm of `x` over the last axis as exporters write it, its parameters `gamma` (and `beta`)."""
    if form == "LayerNormalization":
        return [node("LayerNormalization", [x, "gamma", "beta"], out, axis=-1, epsilon=1e-5)]
    if form == "SimplifiedLayerNormalization":
        return [node("SimplifiedLayerNormalization", [x, "gamma"], out, axis=-1, epsilon=1e-5)]
    # the TorchScript exporter's HF RMSNorm: casts to float32 around it, x * Reciprocal(Sqrt(...)) * w
    return [node("Cast", [x], "xf", to=FLOAT), node("Pow", ["xf", "two"], "sq"),
            node("ReduceMean", ["sq", "last"], "ms", keepdims=1), node("Add", ["ms", "norm_eps"], "mse"),
            node("Sqrt", ["mse"], "rms"), node("Reciprocal", ["rms"], "inv"), node("Mul", ["xf", "inv"], "scaled"),
            node("Cast", ["scaled"], "scaled_f", to=FLOAT), node("Mul", ["gamma", "scaled_f"], out)]


NORM_CONSTANTS = [tensor("two", np.float32(2.0)), tensor("last", np.array([-1], np.int64)),
                  tensor("norm_eps", np.float32(1e-5))]
FORMS = {"LayerNormalization": ("layer", ["gamma", "beta"]), "SimplifiedLayerNormalization": ("rms", ["gamma"]),
         "decomposed": ("rms", ["gamma"])}


def pre_norm(form: str, fused: bool) -> onnx.ModelProto:
    """A site s1 read by a norm and by another op; the norm's output n feeds the next branch b2 of site s2.
    (Not a graph output itself: FuseNorms leaves a LayerNormalization of a graph output, not an RMSNorm.)"""
    params = vectors("q1", "q2", seed=3) + vectors("gamma", "beta", low=0.5, high=1.5) + NORM_CONSTANTS
    kind, gamma_beta = FORMS[form]
    if fused:
        norm = [pair_node(["x", "b1"], "q1", gamma_beta, ["s1", "n"], eps=EPS, scale=2.0, norm_eps=1e-5, norm=kind)]
    else:
        norm = [site_node(["x", "b1"], "q1", "s1", eps=EPS, scale=2.0, axis=-1, rank=3), *norm_nodes(form, "s1", "n")]
    nodes = [node("MatMul", ["x", "w1"], "b1"), *norm, node("MatMul", ["n", "w2"], "b2"),
             site_node(["x", "b1", "b2"], "q2", "s2", eps=EPS, scale=3.0, axis=-1, rank=3),
             node("Identity", ["s1"], "s1_out")]
    return model(nodes, ["x"], ["s2", "s1_out"], weights("w1", "w2") + params, attnres=True)


@pytest.mark.parametrize("form", FORMS)
def test_fuse_norms(form):
    """The site and the norm reading it become one DepthAttentionNorm with outputs (s1, n); a norm over a
    float32 cast of the site takes the cast along."""
    before = pre_norm(form, fused=False)
    m = copy(before)
    assert FuseNorms(view_from_onnx(finalized(before)))(m).count == 1
    expected = pre_norm(form, fused=True)
    assert_same_graph(m, expected, before)
    assert_same_numbers(expected, before)


def test_fuse_norms_leaves_a_norm_whose_weight_comes_later():
    """Gemma's `1 + weight` computed after the site: no place has both, nothing changes."""
    before = pre_norm("SimplifiedLayerNormalization", fused=False)
    nodes = list(before.graph.node)
    before.graph.ClearField("node")
    late = node("Add", ["gamma", "norm_eps"], "gamma_late")
    norm = next(n for n in nodes if n.op_type == "SimplifiedLayerNormalization")
    norm.input[1] = "gamma_late"
    before.graph.node.extend([*nodes[:2], late, *nodes[2:]])
    m = copy(before)
    assert FuseNorms(view_from_onnx(finalized(before)))(m).count == 0 and m == before


# ---- GroupSites -----------------------------------------------------------------------------------------


def block_sites() -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Six sites as RewriteSites writes Block AttnRes with blocks of 3 branches b1..b6 (here all MatMuls of
    x): the first block's sites over x and its partial sum, the second's over x, the first block and its
    own partial sum."""
    nodes = [node("MatMul", ["x", f"w{k}"], f"b{k}") for k in range(1, 7)]
    nodes += [node("Add", ["b1", "b2"], "B12"), node("Add", ["B12", "b3"], "B123"),
              node("Add", ["b4", "b5"], "B45"), node("Add", ["B45", "b6"], "B456")]
    terms = [["x", "b1"], ["x", "B12"], ["x", "B123"], ["x", "B123", "b4"], ["x", "B123", "B45"], ["x", "B123", "B456"]]
    sites = [site_node(t, f"q{k}", f"s{k}", eps=EPS, scale=len(t), axis=-1, rank=3) for k, t in enumerate(terms, 1)]
    return nodes + sites, weights(*(f"w{k}" for k in range(1, 7))) + vectors(*(f"q{k}" for k in range(1, 7)), seed=4)


def test_group_sites():
    """Per block one Partial over the shared history and a Merge per site over its own partial sum; the
    second Partial carries the first's stacked history (x) and appends its new entry (B123)."""
    nodes, params = block_sites()
    outputs = [f"s{k}" for k in range(1, 7)]
    before = model(nodes, ["x"], outputs, params, attnres=True)
    m = copy(before)
    assert GroupSites()(m).count == 6
    kept = nodes[:10]
    first = partial_node([], ["x"], ["q1", "q2", "q3"], ["h1", "r1", "lse1", "acc1", "cols1"], eps=EPS, name="p1")
    second = partial_node(["h1", "r1"], ["B123"], ["q4", "q5", "q6"], ["h2", "r2", "lse2", "acc2", "cols2"], eps=EPS,
                          name="p2")
    extras = ["b1", "B12", "B123", "b4", "B45", "B456"]
    merges = [merge_node(*(("lse1", "acc1", "cols1") if k <= 3 else ("lse2", "acc2", "cols2")), [extras[k - 1]],
                         f"q{k}", f"s{k}", index=(k - 1) % 3, eps=EPS, scale=2.0 if k <= 3 else 3.0, name=f"s{k}")
              for k in range(1, 7)]
    expected = model([*kept, first, *merges[:3], second, *merges[3:]], ["x"], outputs, params, attnres=True)
    assert_same_graph(m, expected, before)
    assert_same_numbers(expected, before)


def test_group_sites_keeps_two_sites_over_a_short_history():
    """Full over 4 sites: groups of 2 over at most MAX_GROUP sources stay DepthAttention nodes."""
    terms = [["x", "b1"], ["x", "b1", "b2"], ["x", "b1", "b2", "b3"], ["x", "b1", "b2", "b3", "b4"]]
    nodes = [node("MatMul", ["x", f"w{k}"], f"b{k}") for k in range(1, 5)]
    nodes += [site_node(t, f"q{k}", f"s{k}", eps=EPS, scale=len(t), axis=-1, rank=3) for k, t in enumerate(terms, 1)]
    before = model(nodes, ["x"], ["s4"], weights("w1", "w2", "w3", "w4") + vectors("q1", "q2", "q3", "q4"),
                   attnres=True)
    m = copy(before)
    assert GroupSites()(m).count == 0 and m == before


# ---- AttachFunctions ------------------------------------------------------------------------------------


def test_attach_functions():
    """Each attnres node gets its overload and the model one function per overload (built by function.py),
    replacing an attnres function already there and keeping another domain's; the attnres domain is
    imported and the IR version raised to 10. The count is the sites: DepthAttention, Merge and pair nodes."""
    pair = pair_node(["x", "b1", "b2"], "q2", ["gamma", "beta"], ["s2", "n2"], eps=EPS, scale=3.0, norm_eps=1e-5,
                     norm="layer")
    nodes = [node("MatMul", ["x", "w1"], "b1"), node("MatMul", ["x", "w2"], "b2"),
             site_node(["x", "b1"], "q1", "s1", eps=EPS, scale=2.0, axis=-1, rank=3), pair,
             partial_node([], ["x", "b1"], ["q3", "q4"], ["h", "r", "lse", "acc", "cols"], eps=EPS, name="p"),
             merge_node("lse", "acc", "cols", ["b2"], "q3", "s3", index=0, eps=EPS, scale=3.0, name="m3"),
             merge_node("lse", "acc", "cols", ["b2"], "q4", "s4", index=1, eps=EPS, scale=3.0, name="m4")]
    params = weights("w1", "w2") + vectors("q1", "q2", "q3", "q4", seed=4) + vectors("gamma", "beta", low=0.5)
    before = model(nodes, ["x"], ["s1", "s2", "n2", "s3", "s4"], params, attnres=False)
    for n in before.graph.node:
        n.overload = ""  # as RewriteSites, GroupSites and FuseNorms leave a pair and a site: no overload yet
    theirs = helper.make_function("user.domain", "Helper", ["a"], ["b"], [helper.make_node("Identity", ["a"], ["b"])],
                                  [helper.make_opsetid("", OPSET)])
    stale = helper.make_function(function.DOMAIN, function.OP_TYPE, ["s0", "query"], ["output"],
                                 [helper.make_node("Identity", ["s0"], ["output"])], [helper.make_opsetid("", OPSET)])
    stale.overload = function.overload((1, -1, 2.0, EPS))
    before.functions.extend([theirs, stale])
    m = copy(before)
    assert AttachFunctions()(m).count == 4

    expected = copy(before)
    overloads = ["", "", "n2_axis-1_scale2.0_eps1e-06", "n3_axis-1_scale3.0_eps1e-06_layer_eps1e-05_a2", "c0_k2_q2",
                 "e1", "e1"]
    for n, name in zip(expected.graph.node, overloads, strict=True):
        n.overload = name
    assert_same_graph(m, expected, before)
    functions = [theirs, function.function_proto((2, -1, 2.0, EPS), OPSET),
                function.pair_function((3, -1, 3.0, EPS, "layer", 1e-5, 2), OPSET),
                function.partial_function(0, 2, 2, OPSET), function.merge_function(1, OPSET)]
    assert [f.SerializeToString() for f in m.functions] == [f.SerializeToString() for f in functions]
    assert {(o.domain, o.version) for o in m.opset_import} == {("", OPSET), ("com.microsoft", 1), (function.DOMAIN, 1)}
    assert m.ir_version == function.IR_VERSION
    onnx.checker.check_model(m)
    run(m)


# ---- exact_sigmoids -------------------------------------------------------------------------------------


def sigmoids(elem: int, opset: int = OPSET) -> onnx.ModelProto:
    return model([node("Sigmoid", ["x"], "y"), node("Sigmoid", ["y"], "z")], ["x"], ["z"], opset=opset, elem=elem)


@pytest.mark.parametrize("elem", [TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16],
                         ids=["float", "double", "float16"])
def test_exact_sigmoids(elem):
    """Each Sigmoid becomes Reciprocal(Add(Exp(Neg(x)), 1)) under its own output name, the 1 one Constant
    of the value's type shared by both."""
    before = sigmoids(elem)
    m = copy(before)
    assert exact_sigmoids(m) == 2
    one = helper.make_tensor("one", elem, [], [1.0])
    expected = model([node("Constant", [], "one", value=one),
                      node("Neg", ["x"], "nx"), node("Exp", ["nx"], "ex"), node("Add", ["ex", "one"], "dx"),
                      node("Reciprocal", ["dx"], "y"),
                      node("Neg", ["y"], "ny"), node("Exp", ["ny"], "ey"), node("Add", ["ey", "one"], "dy"),
                      node("Reciprocal", ["dy"], "z")], ["x"], ["z"], elem=elem)
    assert_same_graph(m, expected, before)
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    assert_same_numbers(expected, before, rtol=1e-3 if elem == TensorProto.FLOAT16 else 1e-6, x=X.astype(dtype))


def test_exact_sigmoids_leaves_opset_6():
    before = sigmoids(FLOAT, opset=6)
    m = copy(before)
    assert exact_sigmoids(m) == 0 and m == before
