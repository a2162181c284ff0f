"""fx frontend: the neutral view (graph_view.py) of a torch.fx GraphModule.
Handles export graphs (aten ops) and symbolic_trace graphs (`operator.add`, `Tensor.add_`, ...);
shapes from `meta["val"]` or `meta["tensor_meta"]`. `split_alpha` first rewrites
`add(a, b, alpha=k)` as `add(a, mul(b, k))`.
"""

from __future__ import annotations

import operator

import networkx as nx
import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.passes.infra.pass_base import PassResult

from ..core.graph_view import Kind, ViewNode, build_view
from ..ops.delta import depth_attention_delta
from ..ops.depth_attention import depth_attention

aten = torch.ops.aten

ADD_TARGETS = {aten.add.Tensor, aten.add_.Tensor, operator.add, operator.iadd, torch.add}
ADD_METHODS = {"add", "add_", "__add__", "__iadd__", "__radd__"}
CAST_TARGETS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.type_as.default}
CAST_METHODS = {"to", "float", "half", "bfloat16", "double", "type", "type_as"}
COPY_TARGETS = {aten.clone.default, aten.contiguous.default, aten.alias.default, aten.lift_fresh_copy.default}
COPY_METHODS = {"clone", "contiguous"}
VIEW_TARGETS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints, torch.reshape, torch.flatten}
VIEW_METHODS = {"view", "reshape", "flatten"}
# contractions: learned operators even when their weight is an activation (q @ k^T)
CONTRACTIONS = {"linear", "mm", "bmm", "matmul", "addmm", "baddbmm", "addbmm", "einsum", "__matmul__",
                "scaled_dot_product_attention"}


def _op_name(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target.__name__.split('.')[0]}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))


def tensor_meta(node: fx.Node, dim=None):
    """(shape, dtype) of a node's tensor value from its metadata, or (None, None); `dim` names
    symbolic dims (default `_dim`)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple((dim or _dim)(d) for d in val.shape), str(val.dtype).replace("torch.", "")
    tm = node.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "shape"):
        return tuple(int(d) for d in tm.shape), str(tm.dtype).replace("torch.", "")
    return None, None


def _dim(d) -> int | str:
    """A dim as an int, or its symbol's name; a symbol the trace specialised (an input dim asked
    dynamic that a weight fixes) is its int."""
    if isinstance(d, torch.SymInt):
        value = d.node.maybe_as_int()
        return value if value is not None else str(d)
    return d


class InputDims:
    """Names a graph's symbolic dims by the input dim the trace's shape env proves them equal to, so a
    padded-then-sliced dim (Mamba2's chunked scan) compares equal to its input dim; others keep their
    own text.
    """

    def __init__(self, gm: fx.GraphModule):
        self.inputs = {}
        for node in gm.graph.nodes:
            val = node.meta.get("val") if node.op == "placeholder" else None
            for d in val.shape if isinstance(val, torch.Tensor) else ():
                if isinstance(d, torch.SymInt) and d.node.expr.is_symbol:
                    self.inputs.setdefault(d.node.expr, d)
        self.names: dict[str, str] = {}

    def __call__(self, d) -> int | str:
        dim = _dim(d)
        if isinstance(dim, int) or d.node.expr.is_symbol:
            return dim
        if dim not in self.names:
            same = (str(s) for sym, s in self.inputs.items()
                    if sym in d.node.expr.free_symbols and statically_known_true(d == s))
            self.names[dim] = next(same, dim)
        return self.names[dim]


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _is_add(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in ADD_TARGETS) or (
        node.op == "call_method" and node.target in ADD_METHODS
    )


def _is_learned(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A contraction (matmul, linear, conv, attention) or a module call holding parameters.

    Ops that read a parameter through a get_attr input are found by the neutral view itself.
    """
    if node.op == "call_module":
        return any(True for _ in gm.get_submodule(node.target).parameters())
    if node.op not in ("call_function", "call_method"):
        return False
    name = _op_name(gm, node).removeprefix("aten.").removeprefix("Tensor.")
    return name in CONTRACTIONS or name.startswith(("conv", "_conv", "_scaled_dot_product"))


def _mode_dependent(gm: fx.GraphModule, node: fx.Node) -> bool:
    """An eval-mode dropout with p > 0: the identity now, not after train() (fx/mode.py)."""
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        return isinstance(mod, torch.nn.modules.dropout._DropoutNd) and mod.p > 0
    if node.target in (aten.dropout.default, torch.nn.functional.dropout):
        return _arg(node, 1, "p", 0.5) != 0
    return False


def _is_passthrough(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Value-preserving on its first operand: identity, copies, eval dropout, same-dtype casts."""
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        return isinstance(mod, torch.nn.Identity) or (isinstance(mod, torch.nn.modules.dropout._DropoutNd) and not mod.training)
    if node.op not in ("call_function", "call_method") or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    target = node.target
    if target in COPY_TARGETS or (node.op == "call_method" and target in COPY_METHODS):
        return True
    if target in (aten.dropout.default, torch.nn.functional.dropout):
        train = _arg(node, 2, "train" if target is aten.dropout.default else "training", True)
        return train is False or _arg(node, 1, "p", 0.5) == 0
    if target in CAST_TARGETS or (node.op == "call_method" and target in CAST_METHODS):
        _, dtype_in = tensor_meta(node.args[0])
        _, dtype_out = tensor_meta(node)
        return dtype_in is not None and dtype_in == dtype_out
    return False


def _is_layout(node: fx.Node) -> bool:
    """A view/reshape that keeps the last axis whole ([B, T, D] <-> [B*T, D])."""
    is_view = (node.op == "call_function" and node.target in VIEW_TARGETS) or (
        node.op == "call_method" and node.target in VIEW_METHODS
    )
    if not is_view or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    shape_in, _ = tensor_meta(node.args[0])
    shape_out, _ = tensor_meta(node)
    return bool(shape_in) and bool(shape_out) and isinstance(shape_in[-1], int) and shape_in[-1] == shape_out[-1]


INPLACE_ADDS = {aten.add_.Tensor, operator.iadd, "add_", "__iadd__"}


def split_alpha(gm: fx.GraphModule) -> PassResult:
    """Rewrite every tensor add `add(a, b, alpha=k)` of `gm` into `add(a, mul(b, k))`, in place, so
    the branch `k * f` is a source like any other.
    """
    changed = False
    for node in list(gm.graph.nodes):
        alpha = node.kwargs.get("alpha", 1) if _is_add(node) else 1
        if alpha == 1 or len(node.args) < 2 or not isinstance(node.args[1], fx.Node):
            continue
        other = node.args[1]
        with gm.graph.inserting_before(node):
            if isinstance(node.target, torch._ops.OpOverload):
                scaled = gm.graph.call_function(aten.mul.Tensor, (other, alpha))
            else:
                scaled = gm.graph.call_function(torch.mul, (other, alpha))
        scaled.meta.update({k: v for k, v in other.meta.items() if k in ("val", "tensor_meta")})
        node.args = (node.args[0], scaled, *node.args[2:])
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "alpha"}
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, changed)


def _add_blocker(node: fx.Node, pos: dict[fx.Node, int]) -> str | None:
    """Why an add can never be a residual link in this fx graph, or None."""
    first = node.args[0]
    if node.target in INPLACE_ADDS and isinstance(first, fx.Node):
        later = [u for u in first.users if pos[u] > pos[node]]
        if later:
            return f"in-place add whose first operand is read again afterwards (by {later[0].name})"
    return None


def _is_depth_attention(node: fx.Node) -> bool:
    """A site: depth_attention, or Delta AttnRes' depth_attention_delta."""
    return node.op == "call_function" and (node.target is depth_attention or node.target is depth_attention_delta)


def _is_size(node: fx.Node) -> bool:
    """A size or size arithmetic (`sym_size`, `s0 * 8`): carries no data, like ONNX's Shape."""
    return node.op == "call_function" and isinstance(node.meta.get("val"), (int, torch.SymInt, torch.SymFloat, torch.SymBool))


def _kind(gm: fx.GraphModule, node: fx.Node) -> Kind:
    if node.op == "placeholder":
        return Kind.INPUT
    if node.op == "get_attr" or _is_size(node):
        return Kind.CONST
    if node.op == "output":
        return Kind.OUTPUT
    if _is_depth_attention(node):
        return Kind.DEPTH_ATTENTION
    if _is_add(node):
        return Kind.ADD
    if _is_passthrough(gm, node):
        return Kind.PASSTHROUGH
    if _is_layout(node):
        return Kind.LAYOUT
    return Kind.OP


def view_from_fx(gm: fx.GraphModule) -> nx.DiGraph:
    """The neutral view of `gm.graph` (node names are the fx node names)."""
    out = []
    pos = {node: i for i, node in enumerate(gm.graph.nodes)}
    dims = InputDims(gm)
    for node in gm.graph.nodes:
        kind = _kind(gm, node)
        if kind == Kind.ADD:
            inputs = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        elif kind in (Kind.PASSTHROUGH, Kind.LAYOUT):
            inputs = [node.args[0]]  # the value; type_as's dtype reference and view sizes are not data
        else:
            inputs = list(dict.fromkeys(node.all_input_nodes))
        shape, dtype = tensor_meta(node, dims)
        is_add = kind == Kind.ADD
        out.append(ViewNode(
            node.name, kind, _op_name(gm, node), [i.name for i in inputs], shape, dtype,
            scalar=is_add and len(inputs) < 2, blocker=_add_blocker(node, pos) if is_add else None,
            learned=kind == Kind.OP and _is_learned(gm, node),
            mode_dependent=kind == Kind.PASSTHROUGH and _mode_dependent(gm, node),
        ))
    return build_view(out)
