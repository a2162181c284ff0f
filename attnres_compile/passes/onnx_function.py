"""The ONNX form of a depth-attention site, shared by the ONNX rewrite and the PyTorch export.

Each site is ONE node `attnres.DepthAttention(s_1, ..., s_n, query)` with attributes
`eps` (float), `scale` (float) and `axis` (int, the feature axis, always negative: counted
from the end, so it means the same for every rank). It is defined by a model-local function
whose body is standard ops only, in float32:

    x_i = Cast(s_i, float32);  k_i = x_i / Sqrt(ReduceMean(Pow(x_i, 2), axis) + eps)
    z_i = ReduceSum(k_i * query, axis)                      (keepdims: [.., 1, ..])
    p   = Softmax(Concat(z_1..z_n, axis), axis)             (over the sources, max-subtracted)
    out = CastLike(scale * Sum_i(Split(p)_i * x_i), s_1)

Why a function node rather than inlined ops with metadata: the site stays one node that a
backend matches by (domain, op_type) and reads its sources, query and attributes from,
without pattern-matching ~10n ops; onnxruntime runs it by inlining the body.
Why Pow(x, 2) rather than x * x: onnxruntime's optimizer fuses Pow, ReduceMean, Add, Sqrt, Div
and the Mul by the (initializer) query into one SimplifiedLayerNormalization per source, which
makes a lone site 1.6-1.8x faster there. In whole models onnxruntime's common-subexpression pass
already shares each source's norm between the sites that read it (the fusion then applies to
some sources only), and the difference is within noise (GPT-2, 12 sublayers: +24% -> +23%).
Why one function per (arity, axis, scale, eps) with those values written into the body
(overload "n<arity>_axis<a>_scale<c>_eps<e>"; in practice one per arity, since preserve
scale = arity) rather than one per arity reading the attributes through references: after
`onnx.inliner.inline_local_functions` a referenced float becomes `Constant(value_float=...)`
and the feature size would come from Shape arithmetic, neither of which
tvm.relax.frontend.onnx imports; baked in, the inlined body is tensor Constants and static
axes only. Overloads need IR version 10, so models are raised to it.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

DOMAIN = "attnres"
OP_TYPE = "DepthAttention"
DOMAIN_VERSION = 1
MIN_OPSET = 15  # CastLike
IR_VERSION = 10


def site_node(inputs: list[str], query: str, output: str, *, eps: float, scale: float, axis: int, rank: int,
              name: str = "") -> onnx.NodeProto:
    """One depth-attention site over `inputs` (rank-`rank` tensors) with pseudo-query `query`, written to `output`."""
    return helper.make_node(OP_TYPE, [*inputs, query], [output], name=name, domain=DOMAIN,
                            eps=float(eps), scale=float(scale), axis=negative_axis(axis, rank))


def negative_axis(axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise ValueError(f"feature axis {axis} is out of range for rank-{rank} sources")
    return axis - rank if axis >= 0 else axis


def signature(node: onnx.NodeProto) -> tuple[int, int, float, float]:
    """(arity, axis, scale, eps) of a site node: what its function body is specialised on."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return len(node.input) - 1, int(attrs["axis"]), float(attrs["scale"]), float(attrs["eps"])


def overload(sig: tuple[int, int, float, float]) -> str:
    """E.g. "n3_axis-1_scale3.0_eps1e-06" (float attributes are float32: shortest float32 spelling)."""
    arity, axis, scale, eps = sig
    return f"n{arity}_axis{axis}_scale{str(np.float32(scale))}_eps{str(np.float32(eps))}"


class _Body:
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
    b = _Body()
    axes = b.const("axes", TensorProto.INT64, [axis])
    eps_c = b.const("eps", TensorProto.FLOAT, [eps], [])
    two = b.const("two", TensorProto.FLOAT, [2.0], [])
    scale_c = b.const("scale", TensorProto.FLOAT, [scale], [])
    qshape = b.const("qshape", TensorProto.INT64, [-1] + [1] * (-axis - 1))  # [D, 1, .., 1]: broadcast on the axis
    query = b.op("Reshape", [b.op("Cast", ["query"], "qf", to=TensorProto.FLOAT), qshape], "qb")
    xs, zs = [], []
    for i in range(n):
        x = b.op("Cast", [f"s{i}"], f"x{i}", to=TensorProto.FLOAT)
        square = b.op("Pow", [x, two], f"sq{i}")
        if opset >= 18:
            mean_sq = b.op("ReduceMean", [square, axes], f"ms{i}", keepdims=1)
        else:
            mean_sq = b.op("ReduceMean", [square], f"ms{i}", axes=[axis], keepdims=1)
        rms = b.op("Sqrt", [b.op("Add", [mean_sq, eps_c], f"mse{i}")], f"rms{i}")
        normed = b.op("Div", [x, rms], f"k{i}")
        zs.append(b.op("ReduceSum", [b.op("Mul", [normed, query], f"kq{i}"), axes], f"z{i}", keepdims=1))
        xs.append(x)
    p = b.op("Softmax", [b.op("Concat", zs, "z", axis=axis)], "p", axis=axis)
    ps = b.op("Split", [p, b.const("splits", TensorProto.INT64, [1] * n)], [f"p{i}" for i in range(n)], axis=axis)
    weighted = [b.op("Mul", [pi, x], f"px{i}") for i, (pi, x) in enumerate(zip(ps, xs))]
    acc = weighted[0] if n == 1 else b.op("Sum", weighted, "acc")
    b.op("CastLike", [b.op("Mul", [acc, scale_c], "scaled"), "s0"], "output")
    fn = helper.make_function(DOMAIN, OP_TYPE, [f"s{i}" for i in range(n)] + ["query"], ["output"], b.nodes,
                              [helper.make_opsetid("", opset)], attributes=["eps", "scale", "axis"],
                              doc_string=f"AttnRes depth attention over {n} sources (attnres-compile): {fn_name}")
    fn.overload = fn_name
    return fn


def default_opset(model: onnx.ModelProto) -> int | None:
    """The model's default-domain (ai.onnx) opset version, or None if it imports none."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)


def attach_functions(model: onnx.ModelProto) -> int:
    """Give every DepthAttention node of `model.graph` its overload and function definition.

    Also imports the `attnres` domain and raises the IR version to one with overloads.
    Returns the number of site nodes.
    """
    opset = default_opset(model)
    sites = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]
    defined = {(f.domain, f.name, f.overload) for f in model.functions}
    for node in sites:
        sig = signature(node)
        node.overload = overload(sig)
        if (DOMAIN, OP_TYPE, node.overload) not in defined:
            model.functions.append(function_proto(sig, opset))
            defined.add((DOMAIN, OP_TYPE, node.overload))
    if sites and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    if sites:
        model.ir_version = max(model.ir_version, IR_VERSION)
    return len(sites)
