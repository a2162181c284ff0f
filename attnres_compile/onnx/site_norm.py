"""Site + norm fusion in an AttnRes ONNX graph: the ONNX form of fx/site_norm.py.

A `DepthAttention` site (axis -1) read by a norm over the last axis (`LayerNormalization`,
`SimplifiedLayerNormalization`, or RMSNorm decomposed as exporters write it, float32 casts
included) becomes one `DepthAttentionNorm` node keeping both output names. The norm's weight and
bias must exist where the site is; other forms stay. Pairs are one-pass sites, so
`onnx_grouping.group_sites`, run after this, regroups only the DepthAttention nodes left.
"""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from .function import DOMAIN, OP_TYPE, pair_node

_LAYER_NORMS = {"LayerNormalization": "layer", "SimplifiedLayerNormalization": "rms"}


class _Graph:
    """The graph's readers per value, producers' positions and constant values."""

    def __init__(self, graph: onnx.GraphProto):
        self.nodes = list(graph.node)
        self.position = {o: i for i, n in enumerate(self.nodes) for o in n.output}
        self.readers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.nodes:
            for name in node.input:
                self.readers.setdefault(name, []).append(node)
        self.outputs = {o.name for o in graph.output}
        self.consts = {i.name: i for i in graph.initializer}
        for node in self.nodes:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                value = next((a.t for a in node.attribute if a.name == "value"), None)
                if value is not None:
                    self.consts[node.output[0]] = value

    def scalar(self, name: str) -> float | None:
        """The value of a one-element constant, else None."""
        tensor = self.consts.get(name)
        array = None if tensor is None else numpy_helper.to_array(tensor)
        return float(array.reshape(-1)[0]) if array is not None and array.size == 1 else None

    def only_reader(self, name: str, *op_types: str) -> onnx.NodeProto | None:
        """The single node reading `name` (not a graph output), if it is one of `op_types`."""
        readers = self.readers.get(name, [])
        if len(readers) == 1 and name not in self.outputs and readers[0].op_type in op_types \
                and readers[0].domain in ("", "ai.onnx"):
            return readers[0]
        return None


def fuse_norms(graph: onnx.GraphProto, float32=lambda name: False) -> int:
    """Replace, in place, each site of `graph` that a norm reads by one pair node; returns how many.
    `float32(value name)`: whether a value is known to be float32 (a same-type Cast after it is an identity)."""
    g = _Graph(graph)
    replace: dict[int, onnx.NodeProto] = {}
    drop: set[int] = set()
    for index, site in enumerate(g.nodes):
        if site.domain != DOMAIN or site.op_type != OP_TYPE or _attr(site, "axis") != -1:
            continue
        x = site.output[0]
        casts = [n for n in g.readers.get(x, []) if _is_float_cast(n)] if float32(x) else []
        matches = []
        for value, cast in [(x, None), *((c.output[0], c) for c in casts)]:
            for match in filter(None, (_layer_norm(g, value), _rms(g, value))):
                steps = match[4]
                if cast is not None and {id(n) for n in g.readers[value]} <= {id(n) for n in steps}:
                    steps = [cast, *steps]  # read by the norm alone: it goes with it (else it stays, reading mixed)
                matches.append((*match[:4], steps))
        if len(matches) != 1:
            continue
        kind, eps, params, last, steps = matches[0]
        if any(g.position.get(p, -1) > index for p in params):
            continue  # a weight computed after the site: no place has it and the site's value
        replace[index] = pair_node(list(site.input[:-1]), site.input[-1], params, [site.output[0], last.output[0]],
                                   eps=_attr(site, "eps"), scale=_attr(site, "scale"), norm_eps=eps, norm=kind,
                                   name=site.name)
        drop.update(id(n) for n in steps)
    if replace:
        nodes = [replace.get(i, n) for i, n in enumerate(g.nodes) if id(n) not in drop]
        graph.ClearField("node")
        graph.node.extend(nodes)
    return len(replace)


def _is_float_cast(node: onnx.NodeProto) -> bool:
    return node.op_type == "Cast" and node.domain in ("", "ai.onnx") and _attr(node, "to") == onnx.TensorProto.FLOAT


def _past_casts(g: _Graph, name: str, steps: list) -> str:
    """`name`, or the output of the float32 casts that alone read it one after the other (appended to
    `steps`): within a norm computed in float32 they are identities."""
    while (cast := g.only_reader(name, "Cast")) is not None and _is_float_cast(cast):
        steps.append(cast)
        name = cast.output[0]
    return name


def _attr(node: onnx.NodeProto, name: str, default=None):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _vector(g: _Graph, name: str) -> bool:
    """A float32 vector constant (an RMSNorm's weight), also through Identity nodes (the TorchScript
    exporter names one initializer for several equal weights: HF's RMSNorm weights start at ones)."""
    while name in g.position and (node := g.nodes[g.position[name]]).op_type == "Identity":
        name = node.input[0]
    tensor = g.consts.get(name)
    return tensor is not None and len(tensor.dims) == 1 and tensor.data_type == onnx.TensorProto.FLOAT


def _axes(g: _Graph, node: onnx.NodeProto) -> list[int] | None:
    """A reduction's axes: its attribute, or its constant second input (opset 18+)."""
    if len(node.input) < 2 or not node.input[1]:
        return _attr(node, "axes")
    tensor = g.consts.get(node.input[1])
    return None if tensor is None else [int(v) for v in numpy_helper.to_array(tensor).reshape(-1)]


def _layer_norm(g: _Graph, x: str):
    norms = [n for n in g.readers.get(x, []) if n.op_type in _LAYER_NORMS and n.domain in ("", "ai.onnx")]
    node = norms[0] if len(norms) == 1 and x not in g.outputs else None
    if node is None or node.input[0] != x or _attr(node, "axis", -1) != -1 or any(o and g.readers.get(o)
                                                                                 for o in node.output[1:]):
        return None
    kind = _LAYER_NORMS[node.op_type]
    params = [p for p in node.input[1:] if p]  # the operator broadcasts them over the last axis: [D]
    if not params or (kind == "rms" and len(params) != 1):
        return None
    return kind, float(_attr(node, "epsilon", 1e-5)), params, node, [node]


def _rms(g: _Graph, x: str):
    readers = g.readers.get(x, [])
    square = next((n for n in readers if n.op_type == "Pow" and n.input[0] == x and g.scalar(n.input[1]) == 2.0), None)
    if square is None:
        return None
    mean = g.only_reader(square.output[0], "ReduceMean")
    if mean is None or list(_axes(g, mean) or []) != [-1] or _attr(mean, "keepdims", 1) != 1:
        return None
    shifted = g.only_reader(mean.output[0], "Add")
    eps = None if shifted is None else next((v for v in map(g.scalar, shifted.input) if v is not None), None)
    root = None if eps is None else g.only_reader(shifted.output[0], "Sqrt")
    if root is None:
        return None
    steps = [square, mean, shifted, root]
    inverse = g.only_reader(root.output[0], "Reciprocal", "Div")
    if inverse is None:
        return None
    if inverse.op_type == "Div" and inverse.input[0] == x and inverse.input[1] == root.output[0]:
        scaled = inverse  # x / sqrt(...)
    else:
        if inverse.op_type == "Div" and (g.scalar(inverse.input[0]) != 1.0 or inverse.input[1] != root.output[0]):
            return None
        steps.append(inverse)
        scaled = g.only_reader(inverse.output[0], "Mul")
        if scaled is None or sorted(scaled.input) != sorted([x, inverse.output[0]]):
            return None
    steps.append(scaled)
    normed = _past_casts(g, scaled.output[0], steps)
    weighted = g.only_reader(normed, "Mul")
    weight = None if weighted is None else next((i for i in weighted.input if i != normed), None)
    if weight is None or not _vector(g, weight):  # no weight, or one computed (Gemma's 1 + w): it stays a Mul
        return "rms", eps, [], steps[-1], steps
    return "rms", eps, [weight], weighted, [*steps, weighted]

