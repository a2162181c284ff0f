"""torch.export programs made convertible by TVM's PyTorch frontend (`from_exported_program`).

`convertible(program)` returns a copy (graph copied, weights shared) where ops the frontend gets
wrong are replaced by equivalents: non-tensor user inputs dropped, `contiguous` -> `clone`, `view`
-> `reshape`, `index` indices taken modulo the size, `cumsum` of bools given its int64 dtype,
unsorted `topk` sorted, and empty 1-D `cat` inputs dropped (HF DynamicCache's start).
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import ConstantArgument, ExportGraphSignature, InputKind

from ...onnx.export import _contiguous_as_clone
from ...utils import pytree_warning


def convertible(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """A copy of `program` without non-tensor user inputs and with explicit contiguous copies."""
    graph_module = pytree_warning.deepcopy(program.graph_module)
    placeholders = {n.name: n for n in graph_module.graph.nodes if n.op == "placeholder"}
    specs, dropped, user = [], set(), 0
    for spec in program.graph_signature.input_specs:
        node = placeholders.get(spec.arg.name)
        if spec.kind == InputKind.USER_INPUT:
            user += 1
            if isinstance(spec.arg, ConstantArgument) and node is not None and not node.users:
                graph_module.graph.erase_node(node)
                dropped.add(user - 1)
                continue
        specs.append(spec)
    _contiguous_as_clone(graph_module)
    for node in list(graph_module.graph.nodes):
        if node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
        elif node.target is torch.ops.aten.index.Tensor:
            _wrap_negative_indices(graph_module.graph, node)
        elif node.target is torch.ops.aten.cumsum.default and node.kwargs.get("dtype") is None:
            _promote_cumsum(node)
        elif node.target is torch.ops.aten.topk.default and len(node.args) > 4 and not node.args[4]:
            node.args = (*node.args[:4], True)
        elif node.target is torch.ops.aten.cat.default:
            _drop_empty_vectors(node)
    graph_module.recompile()
    signature = ExportGraphSignature(input_specs=specs, output_specs=list(program.graph_signature.output_specs))
    with pytree_warning.silenced():
        converted = program._update(graph_module, signature)
    if dropped:  # the calling convention (pytree of the user inputs) without them
        call = converted._module_call_graph[0].signature
        tree = pytree.tree_unflatten(list(range(call.in_spec.num_leaves)), call.in_spec)
        call.in_spec = pytree.tree_structure(_drop(tree, dropped))
    return converted


def _wrap_negative_indices(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """`x[..., idx, :]` with idx -> idx mod size: torch wraps negative indices, TVM's `index`
    converter reads out of bounds (Falcon splits its fused QKV with `[..., [-2], :]`)."""
    source, indices = node.args[0], list(node.args[1])
    shape = source.meta["val"].shape
    for axis, index in enumerate(indices):
        if index is None or not isinstance(shape[axis], int):
            continue
        with graph.inserting_before(node):
            wrapped = graph.call_function(torch.ops.aten.remainder.Scalar, (index, shape[axis]))
        wrapped.meta["val"] = index.meta["val"]
        indices[axis] = wrapped
    node.args = (source, indices)


def _drop_empty_vectors(node: torch.fx.Node) -> None:
    """The inputs of a `cat` without the 1-D tensors of static length 0 that torch skips, when
    another input is kept."""
    tensors = list(node.args[0])
    kept = [t for t in tensors if not _empty_vector(t)]
    if kept and len(kept) < len(tensors):
        node.args = (kept, *node.args[1:])


def _empty_vector(value) -> bool:
    val = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 1 and isinstance(val.shape[0], int) and val.shape[0] == 0


def _promote_cumsum(node: torch.fx.Node) -> None:
    """`cumsum` of a bool or integer tensor gets torch's result dtype, int64, spelled out: the
    frontend keeps the input's dtype, and a cumsum over bools (Whisper's decoder positions from its
    mask) then fails in TVM's code generator."""
    dtype = node.args[0].meta["val"].dtype
    if dtype == torch.bool or (not dtype.is_floating_point and not dtype.is_complex and dtype != torch.int64):
        node.kwargs = {**node.kwargs, "dtype": torch.int64}


def _drop(tree, leaves: set[int]):
    """The pytree of leaf indices without the given leaves (dict entries or sequence elements)."""
    if isinstance(tree, dict):
        return {k: _drop(v, leaves) for k, v in tree.items() if not (isinstance(v, int) and v in leaves)}
    if isinstance(tree, (tuple, list)):
        return type(tree)(_drop(v, leaves) for v in tree if not (isinstance(v, int) and v in leaves))
    return tree
