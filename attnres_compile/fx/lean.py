"""A copy of an exported graph module that runs with less per-call overhead, for decode steps.

`lean_copy` drops torch.export's metadata asserts, same-dtype casts, dead nodes, HF's `repeat_kv`
copy before CPU SDPA (`enable_gqa=True`, bitwise equal) and long attribute paths;
`Lean.inference` calls the sites' kernel directly. Exact while inputs and attributes keep the
trace's dtypes and devices, which `Lean.fits` checks per call (else the graph itself runs).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from ..ops import delta
from ..ops import depth_attention as op
from . import input_guards

aten = torch.ops.aten
_ASSERT = aten._assert_tensor_metadata.default


@dataclass
class Lean:
    """The copy (`module`) and what its removed checks assumed: each input's and each attribute's
    dtype and device index (`Tensor.get_device()`; -1: the CPU, -2: another device, never matched)
    as traced; an attribute as the dict that holds it (its owner's `_parameters`, `_buffers` or
    `__dict__`) and its name."""

    module: fx.GraphModule
    inputs: list[tuple[torch.dtype, int]]
    attrs: list[tuple[dict, str, torch.dtype, int]]
    inference: fx.GraphModule | None = None  # `module` with its sites calling op.direct_forward; None: no sites

    def pick(self, args: tuple) -> fx.GraphModule | None:
        """What runs `args`: `inference` where they fit, they and the attributes are plain
        tensors, grad mode is off and nothing watches the op (`op.unwatched`); `module` where they
        fit; None where they do not (run the graph module itself)."""
        fit = self._fit(args)
        if fit == _PLAIN_FIT and self.inference is not None and not torch.is_grad_enabled() and op.unwatched():
            return self.inference
        return self.module if fit else None

    def fits(self, args: tuple) -> bool:
        """Whether `args` (positional, one per input) and the attributes have their traced dtypes
        and devices, so that the removed checks would pass."""
        return self._fit(args) != _NO_FIT

    def _fit(self, args: tuple) -> int:
        if len(args) != len(self.inputs):
            return _NO_FIT
        plain = True
        for arg, (dtype, device) in zip(args, self.inputs):
            if not isinstance(arg, torch.Tensor) or not _on(arg, dtype, device):
                return _NO_FIT
            plain = plain and type(arg) is torch.Tensor
        for holder, name, dtype, device in self.attrs:
            tensor = holder.get(name)
            if not isinstance(tensor, torch.Tensor) or not _on(tensor, dtype, device):
                return _NO_FIT
            plain = plain and type(tensor) in _PLAIN
        return _PLAIN_FIT if plain else _FIT


_NO_FIT, _FIT, _PLAIN_FIT = 0, 1, 2
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def call(lean: Lean | None, graph_module: fx.GraphModule, args: tuple):
    """`graph_module(*args)`, run on `lean` (its copy, or None: none) where the arguments fit it
    (`Lean.pick`), else on `graph_module` itself, whose own checks then decide."""
    return ((lean.pick(args) if lean is not None else None) or graph_module)(*args)


def _on(tensor: torch.Tensor, dtype: torch.dtype, device: int) -> bool:
    return tensor.dtype is dtype and (tensor.is_cpu if device < 0 else tensor.get_device() == device)


def lean_copy(graph_module: fx.GraphModule, edit: Callable[[fx.Graph], bool] | None = None) -> Lean | None:
    """A Lean copy of a torch.export `graph_module`, `edit` applied first (False: no copy); None where an
    input has no traced value, an attribute is neither tensor nor module, or a node calls a submodule
    other than `_guards_fn` (which stays in the copy)."""
    if any(node.target != "_guards_fn" for node in graph_module.graph.find_nodes(op="call_module")):
        return None
    graph = _copy(graph_module.graph)
    if edit is not None and not edit(graph):
        return None
    _drop_checks(graph)
    _unrepeat_kv(graph)
    graph.eliminate_dead_code(is_impure_node=_impure)
    inputs = [node.meta.get("val") for node in graph.find_nodes(op="placeholder")]
    if not all(isinstance(val, torch.Tensor) for val in inputs):
        return None
    inference = _inference(graph_module, _copy(graph))  # before _flatten_attrs retargets `graph`'s get_attrs
    module = _module(graph_module, graph)
    attrs = _flatten_attrs(module, graph_module)
    if attrs is None:
        return None
    inputs = [(val.dtype, _index(val.device)) for val in inputs]
    return Lean(module, inputs, attrs, inference)


def _copy(graph: fx.Graph) -> fx.Graph:
    copied = fx.Graph(tracer_cls=graph._tracer_cls)
    copied._codegen = copy.deepcopy(graph._codegen)
    copied.output(copied.graph_copy(graph, {}))
    return copied


def _module(graph_module: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule of `graph` with `graph_module`'s submodules, range constraints and hooks:
    every forward pre-hook (torch's input checks or ours: a fresh InputGuards, which caches per
    module, in front of torch's own, and any other) and forward hook (torch.export's exit of what
    its first pre-hook entered)."""
    module = fx.GraphModule(graph_module, graph)
    module._modules.update({k: v for k, v in graph_module._modules.items() if k in module._modules})
    for name in ("range_constraints", "validate_inputs"):
        if hasattr(graph_module, name):
            setattr(module, name, getattr(graph_module, name))
    for key, hook in graph_module._forward_pre_hooks.items():
        ours = isinstance(hook, input_guards.InputGuards) or hook is input_guards._check_input_constraints_pre_hook
        module.register_forward_pre_hook(input_guards.InputGuards() if ours else hook,
                                         with_kwargs=key in graph_module._forward_pre_hooks_with_kwargs)
    for key, hook in graph_module._forward_hooks.items():
        module.register_forward_hook(hook, with_kwargs=key in graph_module._forward_hooks_with_kwargs,
                                     always_call=key in graph_module._forward_hooks_always_called)
    return module


def _inference(graph_module: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule | None:
    """The lean `graph` of `graph_module` (a copy, edited here) with its depth-attention sites
    calling `op.direct_forward` (Delta's: `delta.direct_forward`; Lean.pick's form for plain
    inference); None where it has no site, or where a site's sources were not traced on the CPU or a
    CUDA device (the kernel's devices)."""
    direct = {op.depth_attention: op.direct_forward, delta.depth_attention_delta: delta.direct_forward}
    sites = [n for target in direct for n in graph.find_nodes(op="call_function", target=target)]
    if not sites or not all(_kernel_device(node) for node in sites):
        return None
    for node in sites:
        node.target = direct[node.target]
    module = _module(graph_module, graph)
    return module if _flatten_attrs(module, graph_module) is not None else None


def _kernel_device(node: fx.Node) -> bool:
    sources = node.args[0] if node.args and isinstance(node.args[0], (list, tuple)) else ()
    vals = [s.meta.get("val") if isinstance(s, fx.Node) else None for s in sources]
    return bool(vals) and all(isinstance(v, torch.Tensor) and v.device.type in ("cpu", "cuda") for v in vals)


def _drop_checks(graph: fx.Graph) -> None:
    """Remove the metadata asserts on computed tensors and the casts of a tensor to its own dtype."""
    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.args[0] if node.args else None, fx.Node):
            continue
        source = node.args[0]
        if node.target is _ASSERT and source.op == "call_function":
            graph.erase_node(node)
        elif node.target is aten.to.dtype and len(node.args) == 2 and not node.kwargs:
            val = source.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dtype == node.args[1]:
                node.replace_all_uses_with(source)
                graph.erase_node(node)


_SDPA = aten.scaled_dot_product_attention.default
_FULL = 2**63 - 1  # a slice's end that torch.export writes for `:`


def _unrepeat_kv(graph: fx.Graph) -> None:
    """SDPA calls on the CPU whose key and value are `repeat_kv` copies read the unrepeated K and V,
    with `enable_gqa=True` (on CUDA a mask with `enable_gqa` leaves the fused kernels: kept)."""
    for node in graph.find_nodes(op="call_function", target=_SDPA):
        query = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if len(node.args) < 3 or node.kwargs.get("enable_gqa") or not isinstance(query, torch.Tensor) \
                or query.device.type != "cpu":
            continue
        key, value = (_unrepeated(arg) for arg in node.args[1:3])
        if key is not None and value is not None:
            node.args = (node.args[0], key, value, *node.args[3:])
            node.kwargs = {**node.kwargs, "enable_gqa": True}


def _unrepeated(node) -> fx.Node | None:
    """X where `node` is HF's repeat_kv of X ([b, h, s, d]): reshape(expand(unsqueeze(X, 2) to
    [b, h, r, s, d]), [b, h * r, s, d]), through full slices (`[:, :, None, :, :]`); else None."""
    if not (isinstance(node, fx.Node) and node.target is aten.reshape.default and len(node.users) == 1):
        return None
    expand = node.args[0]
    if not (isinstance(expand, fx.Node) and expand.target is aten.expand.default and len(expand.users) == 1):
        return None
    inner = _through_full_slices(expand.args[0])
    if not (isinstance(inner, fx.Node) and inner.target is aten.unsqueeze.default and inner.args[1] == 2):
        return None
    source = _through_full_slices(inner.args[0])
    val, out = (n.meta.get("val") if isinstance(n, fx.Node) else None for n in (source, node))
    if not (isinstance(val, torch.Tensor) and isinstance(out, torch.Tensor) and val.dim() == out.dim() == 4):
        return None
    repeats = expand.args[1][2] if len(expand.args[1]) == 5 else None
    heads = val.shape[1]
    if not (isinstance(repeats, int) and isinstance(heads, int) and out.shape[1] == heads * repeats):
        return None
    return source


def _through_full_slices(node):
    while (isinstance(node, fx.Node) and node.target is aten.slice.Tensor and len(node.args) >= 4
           and node.args[2] == 0 and node.args[3] == _FULL and (len(node.args) < 5 or node.args[4] == 1)):
        node = node.args[0]
    return node


def _impure(node: fx.Node) -> bool:
    """fx's rule, except that an in-place `detach_` of a fresh `lift_fresh_copy` read by nothing
    else mutates nothing anyone sees, and that the `_guards_fn` call stays (fx would ask its
    module, which the copied graph does not have yet)."""
    if node.op == "call_module":
        return True
    if (node.target is aten.detach_.default and isinstance(node.args[0], fx.Node)
            and node.args[0].target is aten.lift_fresh_copy.default and len(node.args[0].users) == 1):
        return False
    return node.is_impure()


def _flatten_attrs(module: fx.GraphModule, root: fx.GraphModule) -> list | None:
    """Point every tensor get_attr at `self._owner<i>.<name>`, its owning submodule of `root` held
    in the copy's __dict__ (a plain attribute: no Module.__getattr__), and recompile; the
    attributes with their traced dtype and device (an attribute added after tracing: its own now),
    or None where one is not a tensor."""
    owners: dict[int, str] = {}
    attrs = []
    for node in module.graph.find_nodes(op="get_attr"):
        path, _, name = node.target.rpartition(".")
        owner = root.get_submodule(path)
        if isinstance(getattr(owner, name), torch.nn.Module):
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):  # added after tracing (a site's query): as it is now
            val = getattr(owner, name)
            if not isinstance(val, torch.Tensor):
                return None
        key = owners.setdefault(id(owner), f"_owner{len(owners)}")
        module.__dict__[key] = owner
        node.target = f"{key}.{name}"
        holder = next(d for d in (owner._parameters, owner._buffers, owner.__dict__) if name in d)
        attrs.append((holder, name, val.dtype, _index(val.device)))
    module.recompile()
    return attrs


def _index(device: torch.device) -> int:
    """What `Tensor.get_device()` returns for a tensor on a CUDA-like `device`; -1 for the CPU, -2
    for a device without an index (meta): nothing on it fits."""
    if device.type == "cpu":
        return -1
    return device.index if device.index is not None else -2
