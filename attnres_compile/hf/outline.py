"""The rewritten trace made to run on the model's own modules: leaf modules called, dtype checks gone.

`outline` turns the rewritten trace of a wrapper (`<prefix>` names the wrapped backbone) into a
graph over that module: torch.export's `_assert_tensor_metadata` checks (which pin dtypes and
would fail under autocast) and dead nodes go; each call of a LEAF module that reads one outside
tensor plus its own parameters and has one value read outside becomes a `call_module` again
(so PEFT replacements, hooks and `.train()` reach it); targets become relative to the wrapped
module; and nodes inside `<layers>.<i>` get layer index i (`blocks`) for program.split.
"""

from __future__ import annotations

import inspect
from collections import defaultdict

import torch
from torch import fx, nn

aten = torch.ops.aten
_ASSERTS = (aten._assert_tensor_metadata.default,)


def _impure(node: fx.Node) -> bool:
    """fx's rule, except that an in-place `detach_` of a constant (a fresh `lift_fresh_copy`, or the
    lifted constant itself, as a meta-device trace writes it) read by nothing else — HF's
    empty-cache initialisation — mutates nothing anyone sees."""
    if node.op == "call_module":
        return True
    if (node.target is aten.detach_.default and isinstance(node.args[0], fx.Node) and len(node.args[0].users) == 1
            and (node.args[0].target is aten.lift_fresh_copy.default or node.args[0].op == "get_attr")):
        return False
    return node.is_impure()


def _one_argument(module: nn.Module) -> bool:
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    # one positional parameter in all: with optional ones beside it (OPT's positions take the mask and
    # the position ids) the traced input may have come in through another
    return sum(1 for p in params if p.kind in positional) == 1


def _innermost(node: fx.Node) -> tuple[str, str] | None:
    """(the call's key, the module path relative to the trace's root) of `node`'s innermost module."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    key, value = next(reversed(stack.items()))
    path = value[0] if isinstance(value, tuple) else None
    return (key, path) if isinstance(path, str) else None


def outline(traced: fx.Graph, root: nn.Module, prefix: str, layers: str | None) -> tuple[fx.Graph, dict, int]:
    """(the graph over `root`, {node: layer index}, the number of leaf calls outlined) of `traced`,
    a rewritten trace whose `<prefix>` attribute was `root` (module paths are checked on `root`)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(traced, {}))
    for node in [n for target in _ASSERTS for n in graph.find_nodes(op="call_function", target=target)]:
        graph.erase_node(node)
    for node in graph.find_nodes(op="call_module", target="_guards_fn"):  # torch.export's input checks
        graph.erase_node(node)
    graph.eliminate_dead_code(is_impure_node=_impure)
    lead = prefix + "." if prefix else ""
    calls: dict[str, list[fx.Node]] = defaultdict(list)
    paths: dict[str, str] = {}
    for node in graph.nodes:
        found = _innermost(node) if node.op == "call_function" else None
        if found and found[1].startswith(lead):
            calls[found[0]].append(node)
            paths[found[0]] = found[1][len(lead):]
    outlined = sum(_outline_call(graph, nodes, root, paths[key], lead) for key, nodes in calls.items())
    graph.eliminate_dead_code(is_impure_node=_impure)
    for node in graph.find_nodes(op="get_attr"):
        if node.target.startswith(lead):
            node.target = node.target[len(lead):]
        elif not node.target.startswith("attnres."):
            raise ValueError(f"the trace reads {node.target}, outside the converted module")
    graph.lint()
    return graph, _layer_indices(graph, layers, lead), outlined


def _outline_call(graph: fx.Graph, nodes: list[fx.Node], root: nn.Module, path: str, lead: str) -> int:
    try:
        module = root.get_submodule(path)
    except AttributeError:
        return 0
    if next(module.children(), None) is not None or not _one_argument(module):
        return 0
    inside = set(nodes)
    own = {f"{lead}{path}.{name}" for name, _ in [*module.named_parameters(), *module.named_buffers()]}
    external: list[fx.Node] = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg in inside or arg in external:
                continue
            if arg.op == "get_attr" and arg.target not in own:
                return 0  # reads another module's tensor
            if arg.op != "get_attr" and not isinstance(arg.meta.get("val"), torch.SymInt):
                external.append(arg)
    if len(external) != 1:
        return 0
    source = external[0]
    for node in nodes:  # a cast of the input to its own dtype, read outside: the input itself
        val, src = node.meta.get("val"), source.meta.get("val")
        if (node.target is aten.to.dtype and node.args[0] is source and isinstance(val, torch.Tensor)
                and isinstance(src, torch.Tensor) and val.dtype == src.dtype):
            for user in [u for u in node.users if u not in inside]:
                user.replace_input_with(node, source)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    if len(outputs) != 1 or not isinstance(outputs[0].meta.get("val"), torch.Tensor):
        return 0
    with graph.inserting_before(outputs[0]):
        call = graph.call_module(path, (source,))
    call.meta.update({k: outputs[0].meta[k] for k in ("val", "nn_module_stack") if k in outputs[0].meta})
    outputs[0].replace_all_uses_with(call)
    for node in reversed(nodes):
        if not node.users:
            graph.erase_node(node)
    return 1


def _layer_indices(graph: fx.Graph, layers: str | None, root: str) -> dict[fx.Node, int]:
    if not layers:
        return {}
    lead = layers + "."

    def index_of(path: str) -> int | None:
        if not path.startswith(lead):
            return None
        head = path[len(lead):].split(".", 1)[0]
        return int(head) if head.isdigit() else None

    blocks: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            index = index_of(node.target)
        elif node.op == "call_function":
            index = None
            for value in (node.meta.get("nn_module_stack") or {}).values():
                path = value[0] if isinstance(value, tuple) else ""
                found = index_of(path[len(root):]) if isinstance(path, str) and path.startswith(root) else None
                index = found if found is not None else index
        else:
            index = None
        if index is not None:
            blocks[node] = index
    order = [n for n in graph.nodes if n.op in ("call_function", "call_module")]
    before, last = [], None
    for node in order:
        last = blocks.get(node, last)
        before.append(last)
    after, last = [], None
    for node in reversed(order):
        last = blocks.get(node, last)
        after.append(last)
    after.reverse()
    for node, b, a in zip(order, before, after):  # untagged nodes sandwiched inside one layer join it
        if node not in blocks and b is not None and b == a:
            blocks[node] = b
    return blocks
