"""The ONNX form of depth-attention sites, shared by the ONNX rewrite and the PyTorch export.

Five `attnres` node types, each a model-local function of standard float32 ops: DepthAttention,
DepthAttentionPartial, DepthAttentionMerge, DepthAttentionNorm and DepthAttentionDelta.
docs/onnx-format.md is the specification and says why the bodies are written as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper

DOMAIN = "attnres"
OP_TYPE = "DepthAttention"
DOMAIN_VERSION = 1
MIN_OPSET = 15  # CastLike
IR_VERSION = 10
PARTIAL = "DepthAttentionPartial"
MERGE = "DepthAttentionMerge"
PAIR = "DepthAttentionNorm"
DELTA = "DepthAttentionDelta"
SITES = (OP_TYPE, MERGE, PAIR, DELTA)  # one node per site
NORMS = ("layer", "rms")


def site_node(inputs: list[str], query: str, output: str, *, eps: float, scale: float, axis: int, rank: int,
              name: str = "") -> onnx.NodeProto:
    """One depth-attention site over `inputs` (rank-`rank` tensors) with pseudo-query `query`, written to `output`."""
    return helper.make_node(OP_TYPE, [*inputs, query], [output], name=name, domain=DOMAIN,
                            eps=float(eps), scale=float(scale), axis=negative_axis(axis, rank))


def negative_axis(axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise ValueError(f"feature axis {axis} is out of range for rank-{rank} sources")
    return axis - rank if axis >= 0 else axis


def delta_node(inputs: list[str], query: str, base: str, gate: str, output: str, *, eps: float, scale: float,
               axis: int, rank: int, name: str = "") -> onnx.NodeProto:
    """One Delta AttnRes site: `base` + `gate` * the site over `inputs`, written to `output`."""
    return helper.make_node(DELTA, [*inputs, query, base, gate], [output], name=name, domain=DOMAIN,
                            eps=float(eps), scale=float(scale), axis=negative_axis(axis, rank))


def signature(node: onnx.NodeProto) -> tuple[int, int, float, float]:
    """(arity, axis, scale, eps) of a site node (DepthAttention or DepthAttentionDelta): what its
    function body is specialised on."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    extra = 3 if node.op_type == DELTA else 1  # query[, base, gate]
    return len(node.input) - extra, int(attrs["axis"]), float(attrs["scale"]), float(attrs["eps"])


def overload(sig: tuple[int, int, float, float]) -> str:
    """E.g. "n3_axis-1_scale3.0_eps1e-06" (float attributes are float32: shortest float32 spelling)."""
    arity, axis, scale, eps = sig
    return f"n{arity}_axis{axis}_scale{str(np.float32(scale))}_eps{str(np.float32(eps))}"


class Body:
    """Collects the nodes of a function body; `op` returns the output name(s)."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []

    def op(self, op_type: str, inputs: list[str], out: str | list[str], **attrs):
        self.nodes.append(helper.make_node(op_type, inputs, [out] if isinstance(out, str) else out, **attrs))
        return out

    def const(self, out: str, dtype: int, values: list, dims: list[int] | None = None) -> str:
        dims = [len(values)] if dims is None else dims
        return self.op("Constant", [], out, value=helper.make_tensor(out, dtype, dims, values))


def function_proto(sig: tuple[int, int, float, float], opset: int) -> onnx.FunctionProto:
    """The model-local function for sites with signature `sig`, for default-domain `opset`."""
    n, axis, scale, eps = sig
    fn_name = overload(sig)
    b = Body()
    b.op("CastLike", [_site_body(b, sig, opset), "s0"], "output")
    fn = helper.make_function(DOMAIN, OP_TYPE, [f"s{i}" for i in range(n)] + ["query"], ["output"], b.nodes,
                              [helper.make_opsetid("", opset)], attributes=["eps", "scale", "axis"],
                              doc_string=f"AttnRes depth attention over {n} sources (attnres-compile): {fn_name}")
    fn.overload = fn_name
    return fn


def delta_function(sig: tuple[int, int, float, float], opset: int) -> onnx.FunctionProto:
    """The model-local function for Delta sites with signature `sig`, for default-domain `opset`."""
    n, *_ = sig
    b = Body()
    b.op("CastLike", [_site_body(b, sig, opset, delta=True), "base"], "output")
    return _function(DELTA, overload(sig), [f"s{i}" for i in range(n)] + ["query", "base", "gate"], ["output"], b,
                     opset, ["eps", "scale", "axis"], f"Delta AttnRes over {n} sources")


def _site_body(b: Body, sig: tuple[int, int, float, float], opset: int, delta: bool = False) -> str:
    """A site's float32 output in `b`, from inputs s0..s{n-1} and query (`delta`: base + gate * it,
    from inputs base and gate too, the gate folded into the scale)."""
    n, axis, scale, eps = sig
    axes = b.const("axes", TensorProto.INT64, [axis])
    eps_c = b.const("eps", TensorProto.FLOAT, [eps], [])
    scale_c = b.const("scale", TensorProto.FLOAT, [scale], [])
    plus = None
    if delta:
        gate = b.op("Reshape", [b.op("Cast", ["gate"], "gatef", to=TensorProto.FLOAT),
                                b.const("scalar", TensorProto.INT64, [], [0])], "gate0")
        scale_c = b.op("Mul", [scale_c, gate], "gated_scale")
        plus = b.op("Cast", ["base"], "basef", to=TensorProto.FLOAT)
    qshape = b.const("qshape", TensorProto.INT64, [-1] + [1] * (-axis - 1))  # [D, 1, .., 1]: broadcast on the axis
    query = b.op("Reshape", [b.op("Cast", ["query"], "qf", to=TensorProto.FLOAT), qshape], "qb")
    xs = [b.op("Cast", [f"s{i}"], f"x{i}", to=TensorProto.FLOAT) for i in range(n)]
    columns = (b.op("Unsqueeze", [query, b.const("col", TensorProto.INT64, [1])], "qcol"), None) if axis == -1 else None
    return _attend(b, xs, query, eps_c, scale_c, axes, axis, opset, columns=columns, plus=plus)


# ---- the fused site + norm pair -------------------------------------------------------------------


def pair_node(inputs: list[str], query: str, params: list[str], outputs: list[str], *, eps: float, scale: float,
              norm_eps: float, norm: str, name: str = "") -> onnx.NodeProto:
    """One site over `inputs` and the norm of its output ([mixed, normed] = `outputs`), over the last
    axis, with `params` its weight and bias (as many as it has: [], [weight], [weight, bias])."""
    return helper.make_node(PAIR, [*inputs, query, *params], outputs, name=name, domain=DOMAIN, eps=float(eps),
                            scale=float(scale), axis=-1, norm_eps=float(norm_eps), norm=norm, affine=len(params))


def pair_signature(node: onnx.NodeProto) -> tuple[int, int, float, float, str, float, int]:
    """(arity, axis, scale, eps, norm, norm_eps, affine) of a pair node: what its function is specialised on."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    norm = attrs["norm"].decode() if isinstance(attrs["norm"], bytes) else attrs["norm"]
    affine = int(attrs["affine"])
    return (len(node.input) - 1 - affine, int(attrs["axis"]), float(attrs["scale"]), float(attrs["eps"]), norm,
            float(attrs["norm_eps"]), affine)


def pair_overload(sig: tuple) -> str:
    """E.g. "n3_axis-1_scale3.0_eps1e-06_rms_eps1e-05_a1"."""
    *site, norm, norm_eps, affine = sig
    return f"{overload(tuple(site))}_{norm}_eps{str(np.float32(norm_eps))}_a{affine}"


def pair_function(sig: tuple, opset: int) -> onnx.FunctionProto:
    """The model-local function for pairs with signature `sig` (pair_signature), for `opset`."""
    n, axis, scale, eps, norm, norm_eps, affine = sig
    b = Body()
    total = _site_body(b, (n, axis, scale, eps), opset)
    b.op("CastLike", [total, "s0"], "mixed")
    axes = b.const("norm_axes", TensorProto.INT64, [-1])
    norm_eps_c = b.const("norm_eps", TensorProto.FLOAT, [norm_eps], [])
    if norm == "layer":
        mean = _reduce(b, "ReduceMean", total, axes, -1, "norm_mean", opset)
        x = b.op("Sub", [total, mean], "norm_centred")
    else:
        x = total
    var = _reduce(b, "ReduceMean", b.op("Mul", [x, x], "norm_sq"), axes, -1, "norm_var", opset)
    out = b.op("Div", [x, b.op("Sqrt", [b.op("Add", [var, norm_eps_c], "norm_vare")], "norm_std")], "norm_n")
    params = ["weight", "bias"][:affine]
    for i, (param, op_type) in enumerate(zip(params, ("Mul", "Add"))):
        out = b.op(op_type, [out, b.op("Cast", [param], f"norm_p{i}", to=TensorProto.FLOAT)], f"norm_a{i}")
    b.op("CastLike", [out, "s0"], "normed")
    return _function(PAIR, pair_overload(sig), [f"s{i}" for i in range(n)] + ["query", *params], ["mixed", "normed"],
                     b, opset, ["eps", "scale", "axis", "norm_eps", "norm", "affine"],
                     f"AttnRes depth attention over {n} sources and the {norm} norm of its output")


def _attend(b: Body, xs: list[str], query: str, eps: str, scale: str, axes: str, axis: int, opset: int,
            state: tuple[str, str] | None = None, columns: tuple[str, str | None] | None = None,
            plus: str | None = None) -> str:
    """scale * sum_i softmax_i(z_i) x_i over float32 terms `xs`, z_i = query . RMSNorm(x_i) along `axis`;
    `state` (lse, acc) is one more term, a history already reduced to its logsumexp and weighted mean.

    With `columns` (matrix [D, C], pick) the logits are a MatMul over the source's RMS, so
    onnxruntime computes them once for every site a source feeds; without, the RMSNorm pattern
    onnxruntime fuses. The last op is a Sum, never an Add (`plus`: Delta's plain sum, unweighted).
    See docs/onnx-format.md, *Why function nodes, and why these bodies*."""
    zs = [state[0]] if state else []
    if columns:
        matrix, pick = columns
        for i, x in enumerate(xs):
            mean_sq = _reduce(b, "ReduceMean", b.op("Mul", [x, x], f"sq{i}"), axes, axis, f"ms{i}", opset)
            rms = b.op("Sqrt", [b.op("Add", [mean_sq, eps], f"mse{i}")], f"rms{i}")
            dot = b.op("MatMul", [x, matrix], f"dots{i}")
            dot = b.op("Gather", [dot, pick], f"dot{i}", axis=-1) if pick else dot          # [.., 1]
            zs.append(b.op("Div", [dot, rms], f"z{i}"))
    else:
        two = b.const("two", TensorProto.FLOAT, [2.0], [])
        for i, x in enumerate(xs):
            mean_sq = _reduce(b, "ReduceMean", b.op("Pow", [x, two], f"sq{i}"), axes, axis, f"ms{i}", opset)
            normed = b.op("Div", [x, b.op("Sqrt", [b.op("Add", [mean_sq, eps], f"mse{i}")], f"rms{i}")], f"k{i}")
            zs.append(_reduce(b, "ReduceSum", b.op("Mul", [normed, query], f"kq{i}"), axes, axis, f"z{i}", opset))
    terms = ([state[1]] if state else []) + xs
    if len(terms) == 2:  # a two-way softmax is a sigmoid: elementwise ops, no per-row Concat/Softmax/Split
        second = b.op("Mul", [b.op("Sigmoid", [b.op("Sub", [zs[1], zs[0]], "gap")], "t"), scale], "p1")
        ps = [b.op("Sub", [scale, second], "p0"), second]
    else:
        p = b.op("Mul", [b.op("Softmax", [b.op("Concat", zs, "z", axis=axis)], "p", axis=axis), scale], "ps")
        ps = b.op("Split", [p, b.const("splits", TensorProto.INT64, [1] * len(terms))],
                  [f"p{i}" for i in range(len(terms))], axis=axis)
    weighted = [b.op("Mul", [pi, x], f"px{i}") for i, (pi, x) in enumerate(zip(ps, terms))]
    weighted = ([plus] if plus else []) + weighted
    return weighted[0] if len(weighted) == 1 else b.op("Sum", weighted, "total")


def default_opset(model: onnx.ModelProto) -> int | None:
    """The model's default-domain (ai.onnx) opset version, or None if it imports none."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)


def definition(node: onnx.NodeProto) -> tuple[str, Callable[[int], onnx.FunctionProto]]:
    """(overload, build(opset) -> function) of an attnres node: what its function is specialised on."""
    if node.op_type == OP_TYPE:
        sig = signature(node)
        return overload(sig), lambda opset: function_proto(sig, opset)
    if node.op_type == DELTA:
        sig = signature(node)
        return overload(sig), lambda opset: delta_function(sig, opset)
    if node.op_type == PARTIAL:
        structure = partial_structure(node)
        return partial_overload(*structure), lambda opset: partial_function(*structure, opset)
    if node.op_type == PAIR:
        sig = pair_signature(node)
        return pair_overload(sig), lambda opset: pair_function(sig, opset)
    extras = len(node.input) - 4
    return merge_overload(extras), lambda opset: merge_function(extras, opset)


def attach_functions(model: onnx.ModelProto) -> int:
    """Give every attnres node of `model.graph` its overload and function definition, replacing any
    attnres definitions already there; imports the domain and raises the IR version to one with
    overloads. Returns the number of sites (DepthAttention and Merge nodes).
    """
    opset = default_opset(model)
    ours = [n for n in model.graph.node if n.domain == DOMAIN]
    functions: dict[tuple[str, str], onnx.FunctionProto] = {}
    for node in ours:
        node.overload, build = definition(node)
        if (node.op_type, node.overload) not in functions:
            functions[node.op_type, node.overload] = build(opset)
    kept = [f for f in model.functions if f.domain != DOMAIN]
    model.ClearField("functions")
    model.functions.extend(kept + list(functions.values()))
    if ours and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    if ours:
        model.ir_version = max(model.ir_version, IR_VERSION)
    return sum(n.op_type in SITES for n in ours)


# ---- the two-phase pair ---------------------------------------------------------------------------


def partial_node(carried: list[str], new: list[str], queries: list[str], outputs: list[str], *, eps: float,
                 name: str) -> onnx.NodeProto:
    """A Partial over `carried` (a previous Partial's (history_out, rms_out), or []) plus `new` entries,
    for `queries`; `outputs` are (history_out, rms_out, lse, acc, columns)."""
    carry = int(bool(carried))
    node = helper.make_node(PARTIAL, [*carried, *new, *queries], outputs, name=name, domain=DOMAIN, eps=float(eps),
                            axis=-1, queries=len(queries), carry=carry)
    node.overload = partial_overload(carry, len(new), len(queries))
    return node

def merge_node(lse: str, acc: str, columns: str, extras: list[str], query: str, output: str, *, index: int,
               eps: float, scale: float, name: str) -> onnx.NodeProto:
    """The Merge of one site: row `index` of a Partial's state (lse, acc) with the site's `extras`."""
    node = helper.make_node(MERGE, [lse, acc, columns, *extras, query], [output], name=name, domain=DOMAIN,
                            index=int(index), eps=float(eps), scale=float(scale), axis=-1)
    node.overload = merge_overload(len(extras))
    return node

def partial_structure(node: onnx.NodeProto) -> tuple[int, int, int]:
    """(carry, new entries, queries) of a Partial node: what its function body is specialised on."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    carry, queries = int(attrs["carry"]), int(attrs["queries"])
    return carry, len(node.input) - 2 * carry - queries, queries


def partial_overload(carry: int, new: int, queries: int) -> str:
    return f"c{carry}_k{new}_q{queries}"

def merge_overload(extras: int) -> str:
    return f"e{extras}"

def _ref(b: Body, out: str, attr: str, kind: int) -> str:
    """A Constant holding the node's attribute `attr` (an attribute reference)."""
    field = {AttributeProto.FLOAT: "value_float", AttributeProto.INT: "value_int"}[kind]
    ref = AttributeProto(name=field, ref_attr_name=attr, type=kind)
    node = helper.make_node("Constant", [], [out])
    node.attribute.append(ref)
    b.nodes.append(node)
    return out

def _reduce(b: Body, op: str, x: str, axes: str, axis: int, out: str, opset: int) -> str:
    """A keepdims reduction over one axis: axes as an input from opset 18 (ReduceSum: 13), else an attribute."""
    if opset >= (13 if op == "ReduceSum" else 18):
        return b.op(op, [x, axes], out, keepdims=1)
    return b.op(op, [x], out, axes=[axis], keepdims=1)

def _stack(b: Body, names: list[str], axes: str, prefix: str) -> list[str]:
    """Each input cast to float32 and given a unit axis before the feature axis."""
    return [b.op("Unsqueeze", [b.op("Cast", [n], f"{prefix}f{i}", to=TensorProto.FLOAT), axes], f"{prefix}u{i}")
            for i, n in enumerate(names)]

def _function(op_type: str, overload: str, inputs: list[str], outputs: list[str], b: Body, opset: int,
              attributes: list[str], doc: str) -> onnx.FunctionProto:
    fn = helper.make_function(DOMAIN, op_type, inputs, outputs, b.nodes, [helper.make_opsetid("", opset)],
                              attributes=attributes, doc_string=f"{doc} (attnres-compile): {overload}")
    fn.overload = overload
    return fn

def partial_function(carry: int, new: int, queries: int, opset: int) -> onnx.FunctionProto:
    """The function of Partial nodes with this structure, for default-domain `opset`."""
    b = Body()
    m1, m2 = b.const("m1", TensorProto.INT64, [-1]), b.const("m2", TensorProto.INT64, [-2])
    zero = b.const("zero", TensorProto.INT64, [0])
    eps = _ref(b, "eps", "eps", AttributeProto.FLOAT)
    carried = ["history", "rms"] if carry else []
    inputs = carried + [f"h{i}" for i in range(new)] + [f"q{i}" for i in range(queries)]
    entries = _stack(b, inputs[len(carried):len(carried) + new], m2, "h")
    rms = [b.op("Sqrt", [b.op("Add", [_reduce(b, "ReduceMean", b.op("Mul", [h, h], f"hh{i}"), m1, -1, f"ms{i}", opset),
                                       eps], f"mse{i}")], f"rms{i}") for i, h in enumerate(entries)]
    stacked = _concat(b, carried[:1] + entries, "history_out", -2)
    norms = _concat(b, carried[1:] + rms, "rms_out", -2)                              # [.., J, 1]
    qs = [b.op("Unsqueeze", [b.op("Cast", [q], f"qf{i}", to=TensorProto.FLOAT), zero], f"qu{i}")
          for i, q in enumerate(inputs[len(carried) + new:])]
    q_cols = b.op("Transpose", [_concat(b, qs, "qrows", 0)], "qcols", perm=[1, 0])    # [D, B]
    z = b.op("Div", [b.op("MatMul", [stacked, q_cols], "dots"), norms], "z")           # [.., J, B]
    zt = b.op("Einsum", [z], "zt", equation="...jb->...bj")                            # [.., B, J]
    top = _reduce(b, "ReduceMax", zt, m1, -1, "top", opset)                            # [.., B, 1]
    ez = b.op("Exp", [b.op("Sub", [zt, top], "shifted")], "ez")
    total = _reduce(b, "ReduceSum", ez, m1, -1, "total", opset)
    lse = b.op("Add", [top, b.op("Log", [total], "log_total")], "lse_rows")
    b.op("Einsum", [lse], "lse", equation="...bo->...ob")                              # [.., 1, B]
    b.op("MatMul", [b.op("Div", [ez, total], "p"), stacked], "acc")
    b.op("Identity", [q_cols], "columns")
    return _function(PARTIAL, partial_overload(carry, new, queries), inputs,
                     ["history_out", "rms_out", "lse", "acc", "columns"],
                     b, opset, ["eps", "axis", "queries", "carry"], "AttnRes phase 1 over a shared history")


def _concat(b: Body, parts: list[str], out: str, axis: int) -> str:
    return b.op("Concat", parts, out, axis=axis) if len(parts) > 1 else b.op("Identity", parts, out)


def merge_function(extras: int, opset: int) -> onnx.FunctionProto:
    """The function of Merge nodes with `extras` extra terms, for default-domain `opset`."""
    b = Body()
    m1 = b.const("m1", TensorProto.INT64, [-1])
    eps = _ref(b, "eps_c", "eps", AttributeProto.FLOAT)
    scale = _ref(b, "scale_c", "scale", AttributeProto.FLOAT)
    index = _ref(b, "index", "index", AttributeProto.INT)
    inputs = ["lse", "acc", "columns"] + [f"e{i}" for i in range(extras)] + ["query"]
    lse = b.op("Gather", ["lse", index], "lse_i", axis=-1)           # [.., 1]
    acc = b.op("Gather", ["acc", index], "acc_i", axis=-2)           # [.., D]
    xs = [b.op("Cast", [e], f"x{i}", to=TensorProto.FLOAT) for i, e in enumerate(inputs[3:-1])]
    query = b.op("Cast", ["query"], "qf", to=TensorProto.FLOAT)
    # one extra (Block): the fused RMSNorm form; more (Full): the group's dots, shared by its Merges
    pick = b.op("Unsqueeze", [index, b.const("zero", TensorProto.INT64, [0])], "pick") if extras > 1 else None
    columns = ("columns", pick) if pick else None
    b.op("CastLike", [_attend(b, xs, query, eps, scale, m1, -1, opset, (lse, acc), columns=columns), "e0"], "output")
    return _function(MERGE, merge_overload(extras), inputs, ["output"], b, opset, ["index", "eps", "scale", "axis"],
                     "AttnRes phase 2 of one site")
