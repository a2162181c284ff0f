"""A converted model's rewritten graph as data, and the Python that runs it against the live modules.

The graph (per parameter dtype) is JSON: torch ops by name (OP_NAMESPACES), `operator` functions,
`torch.sym_*`, plain-data arguments; reading it runs no code, and `check` compares every name with
the model. `compiled(device)` compiles one function for the backbone and one per layer, so layers
stay called modules and attributes are read through the module tree on every call.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from ..pt2.trust import OPERATOR_FNS, does_io

FORMAT = 1
OP_NAMESPACES = ("aten", "attnres", "prims")
_SYM = {f.__name__: f for f in (torch.sym_max, torch.sym_min, torch.sym_not, torch.sym_float, torch.sym_int,
                                torch.sym_ite, torch.sym_sum)}


class GraphDataError(ValueError):
    """The graph data names something this reader does not allow or the model lacks."""


# ---- graph <-> data ------------------------------------------------------------------------------

def _enc(value):
    if isinstance(value, fx.Node):
        return {"n": value.name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else {"f": repr(value)}
    if isinstance(value, (list, tuple)):
        return {"l" if isinstance(value, list) else "t": [_enc(v) for v in value]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    raise GraphDataError(f"an argument of type {type(value).__name__} ({value!r:.60}) has no data form")


def _target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return "op:" + target._schema.name + "." + (target._overloadname or "default")
    if getattr(target, "__module__", None) in ("_operator", "operator") and target.__name__ in OPERATOR_FNS:
        return "operator:" + target.__name__
    if _SYM.get(getattr(target, "__name__", None)) is target:
        return "sym:" + target.__name__
    raise GraphDataError(f"the call target {target!r:.80} has no data form")


def to_data(graph: fx.Graph, blocks: dict[fx.Node, int], extra: dict) -> dict:
    """`graph` as JSON-ready data; `blocks`: the layer index of each node that has one; `extra`:
    what else the reader needs (geometry, output class, dtype), stored beside the nodes."""
    nodes = []
    for node in graph.nodes:
        row = {"name": node.name, "op": node.op}
        if node.op == "call_function":
            row["target"] = _target_name(node.target)
        elif node.op != "output":
            row["target"] = node.target
        if node.args:
            row["args"] = [_enc(a) for a in node.args]
        if node.kwargs:
            row["kwargs"] = {k: _enc(v) for k, v in node.kwargs.items()}
        if node in blocks:
            row["block"] = blocks[node]
        nodes.append(row)
    return {"format": FORMAT, **extra, "nodes": nodes}


def _resolve(name: str):
    kind, _, rest = name.partition(":")
    if kind == "operator" and rest in OPERATOR_FNS:  # arithmetic: never call, attrgetter or methodcaller
        return getattr(operator, rest)
    if kind == "sym" and rest in _SYM:
        return _SYM[rest]
    if kind == "op":
        qualified, _, overload = rest.rpartition(".")
        namespace, _, op_name = qualified.partition("::")
        if namespace in OP_NAMESPACES and op_name.isidentifier() and overload.isidentifier() and \
                not does_io(namespace, op_name):
            if namespace == "attnres":
                from ..ops import depth_attention  # noqa: F401  (registers torch.ops.attnres.*)
            try:
                return getattr(getattr(getattr(torch.ops, namespace), op_name), overload)
            except (AttributeError, RuntimeError):
                raise GraphDataError(f"this torch has no operator {rest}") from None
    raise GraphDataError(f"call target {name!r:.80} is not one this reader allows")


def _dec(value, nodes: dict[str, fx.Node], devices: dict[str, torch.device]):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict) and len(value) == 1:
        (kind, inner), = value.items()
        if kind == "n" and inner in nodes:
            return nodes[inner]
        if kind in ("l", "t") and isinstance(inner, list):
            items = [_dec(v, nodes, devices) for v in inner]
            return items if kind == "l" else tuple(items)
        if kind == "f" and inner in ("nan", "inf", "-inf"):
            return float(inner)
        if kind == "dtype" and isinstance(getattr(torch, str(inner), None), torch.dtype):
            return getattr(torch, inner)
        if kind == "device" and isinstance(inner, str):
            return devices.get(inner) or torch.device(inner)
        if kind == "layout" and isinstance(getattr(torch, str(inner), None), torch.layout):
            return getattr(torch, inner)
        if kind == "memory_format" and isinstance(getattr(torch, str(inner), None), torch.memory_format):
            return getattr(torch, inner)
    raise GraphDataError(f"argument {value!r:.80} is not one this reader allows")


def from_data(data: dict, device: torch.device | None = None) -> tuple[fx.Graph, dict[fx.Node, int]]:
    """The graph of `to_data`'s data and each node's layer index; with `device`, the device the graph
    was traced on (`data["device"]`) is replaced by it (HF code places its masks and ranges on the
    input's device, which the trace wrote down)."""
    traced = data.get("device")
    devices = {traced: torch.device(device)} if device is not None and isinstance(traced, str) else {}
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        raise GraphDataError("no node list")
    graph, nodes, blocks = fx.Graph(), {}, {}
    for row in data["nodes"]:
        if not isinstance(row, dict) or row.get("op") not in ("placeholder", "get_attr", "call_function",
                                                                "call_module", "output"):
            raise GraphDataError(f"node {row!r:.80} is not one this reader allows")
        op, args = row["op"], tuple(_dec(a, nodes, devices) for a in row.get("args", ()))
        kwargs = {str(k): _dec(v, nodes, devices) for k, v in row.get("kwargs", {}).items()}
        target = row.get("target")
        if op == "call_function":
            target = _resolve(target)
        elif op == "output":
            graph.output(args[0])
            break
        elif not isinstance(target, str) or not all(p.isidentifier() or p.isdigit() for p in target.split(".")):
            raise GraphDataError(f"target {target!r:.80} is not a module path")
        node = graph.create_node(op, target, args, kwargs, name=str(row.get("name")))
        if node.name != row.get("name"):
            raise GraphDataError(f"node name {row.get('name')!r:.80} is not a valid name")
        nodes[node.name] = node
        if isinstance(row.get("block"), int):
            blocks[node] = row["block"]
    graph.lint()
    return graph, blocks


# ---- split by layer, compile ----------------------------------------------------------------------

@dataclass
class Compiled:
    """The backbone's function and one per layer (`blocks[i]` for layer i; empty: not split)."""

    top: object
    blocks: list


def split(graph: fx.Graph, blocks: dict[fx.Node, int], layers: str | None) -> tuple[fx.Graph, list[fx.Graph]]:
    """(the backbone's graph, one graph per layer) of an outlined graph whose nodes carry layer indices.
    Each layer becomes `call_module(<layers>.<i>, (attnres_blocks[k], *inputs))` with targets relative
    to the layer. The graph is returned whole (with an unused `attnres_blocks` placeholder) without
    `layers`, without indexed nodes, or where a layer's nodes are not one run in graph order."""
    order = [n for n in graph.nodes if n.op != "get_attr"]
    runs: list[int] = []
    for node in order:
        index = blocks.get(node)
        if index is not None and (not runs or runs[-1] != index):
            runs.append(index)
    if not layers or not runs or len(runs) != len(set(runs)):
        with graph.inserting_before(next(iter(graph.nodes))):
            graph.placeholder("attnres_blocks")
        return graph, []
    top = fx.Graph()
    block_list = top.placeholder("attnres_blocks")
    env: dict[fx.Node, fx.Node] = {}
    graphs: list[fx.Graph] = []

    def lookup(n: fx.Node) -> fx.Node:
        if n not in env and n.op == "get_attr":
            env[n] = top.get_attr(n.target)
        return env[n]

    members: dict[int, list[fx.Node]] = {}
    for node in order:
        if node in blocks:
            members.setdefault(blocks[node], []).append(node)
    for node in order:
        index = blocks.get(node)
        if index is None:
            env[node] = top.node_copy(node, lookup)
            continue
        if node is not members[index][0]:
            continue
        prefix = f"{layers}.{index}."
        block_graph, inputs, outputs = _block_graph(members[index], set(members[index]), prefix)
        graphs.append(block_graph)
        fn = top.call_function(operator.getitem, (block_list, len(graphs) - 1))
        call = top.call_module(f"{layers}.{index}", (fn, *[lookup(i) for i in inputs]))
        for k, out in enumerate(outputs):
            env[out] = top.call_function(operator.getitem, (call, k))
    return top, graphs


def _block_graph(group: list[fx.Node], inside: set, prefix: str) -> tuple[fx.Graph, list[fx.Node], list[fx.Node]]:
    """One layer's graph: placeholders for the values it reads from outside (other nodes, and
    attributes not under `prefix`), its nodes, and a tuple of the values read after it."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []

    def lookup(n: fx.Node) -> fx.Node:
        if n in env:
            return env[n]
        if n.op == "get_attr" and n.target.startswith(prefix):
            env[n] = graph.get_attr(n.target[len(prefix):])
        else:
            inputs.append(n)
            env[n] = graph.placeholder(f"in_{n.name}")
        return env[n]

    for node in group:
        for a in node.all_input_nodes:
            if a not in inside:
                lookup(a)
    for node in group:  # the inputs' placeholders exist by now, in reading order
        copied = graph.node_copy(node, lookup)
        if node.op == "call_module" and node.target.startswith(prefix):
            copied.target = node.target[len(prefix):]
        env[node] = copied
    outputs = [n for n in group if any(u not in inside for u in n.users)]
    graph.output(tuple(env[n] for n in outputs))
    return graph, inputs, outputs


def compile_graph(graph: fx.Graph, name: str):
    """A Python function `(self, *placeholders)` computing `graph` (fx's code generator)."""
    graph._codegen = fx.graph.CodeGen()
    code = graph.python_code(root_module="self")
    namespace = dict(code.globals)
    exec(compile(code.src, f"<attnres {name}>", "exec"), namespace)  # noqa: S102 - fx's code of our graph
    return namespace["forward"]
