"""A decoder's ONNX graph grown from a shallow export: the middle layer copied up to the model's depth.

torch.export and torch.onnx's decompositions cost about a second a SmolLM2 layer; copying a layer's
nodes costs milliseconds. `deepen` takes the exporter's graph of a `SHALLOW`-layer decoder before
the optimizer runs (every weight still an initializer named by its module path, every node tagged
with its module scopes) and copies layer `TEMPLATE` for layers SHALLOW .. depth - 1, where the graph
shows the last layer to be the template shifted by one: the same ops, attributes and constants,
reading the template where the template reads the first layer, the same shared values (masks,
rotary tables) and its own weights and cache inputs. A copy reads layer i's weights from `tensors`.
Anything else returns False with the graph untouched; the caller exports the whole model.
The fx form of the same idea is hf/replicate.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import onnx_ir as ir
import torch
from onnx_ir.tensor_adapters import TorchTensor

from ..core.replicate import SHALLOW, TEMPLATE, Mismatch, layer_span

SCOPES = "pkg.torch.onnx.name_scopes"  # torch.onnx's record of a node's module path
# ops whose two operands may come in either order: torch.export writes a sum of sizes (past length +
# sequence length) in the order of its symbols, which differ by layer (Mistral's sliding-window mask)
COMMUTATIVE = {("", "Add"), ("", "Mul"), ("", "And"), ("", "Or"), ("", "Equal")}
_SCOPED = ("namespace", SCOPES, "pkg.torch.onnx.class_hierarchy")


def deepen(graph: ir.Graph, prefix: str, depth: int, lead_inputs: int, lead_outputs: int,
           tensors: Callable[[str], torch.Tensor]) -> bool:
    """Grow `graph`, the export of a SHALLOW-layer decoder whose layer i is the module `<prefix><i>`,
    to `depth` layers in place; False (graph untouched) where it is not a template and its shift.
    Inputs: `lead_inputs` shared ones, then the same number per layer (its KV cache); outputs
    likewise after `lead_outputs`. `tensors(name)`: the weight of initializer `name` of a new layer."""
    try:
        layout = _Layout(graph, prefix, lead_inputs, lead_outputs)
        recipe = _recipe(layout)
        weights = _weights(layout, recipe, depth, tensors)
    except Mismatch:
        return False
    _Grower(layout, recipe, weights).grow(depth)
    return True


class _Layout:
    """The shallow graph cut into shared inputs, per-layer inputs, prelude, layers and postlude."""

    def __init__(self, graph: ir.Graph, prefix: str, lead_inputs: int, lead_outputs: int):
        self.graph, self.prefix = graph, prefix
        self.pattern = re.compile(re.escape(prefix) + r"(\d+)(?=\.|$)")
        self.scope = re.compile(r"'" + re.escape(prefix) + r"(\d+)(?=[.'])")
        inputs = list(graph.inputs)
        per, extra = divmod(len(inputs) - lead_inputs, SHALLOW)
        outputs = list(graph.outputs)
        per_out, extra_out = divmod(len(outputs) - lead_outputs, SHALLOW)
        if extra or per < 0 or extra_out or per_out < 0:
            raise Mismatch
        self.per_input, self.per_output, self.lead_outputs = per, per_out, lead_outputs
        self.inputs = {v: (i // per, i % per) for i, v in enumerate(inputs[lead_inputs:])} if per else {}
        self.layer: dict[ir.Node, int] = {}
        self.layers: list[list[ir.Node]] = [[] for _ in range(SHALLOW)]
        self.postlude: list[ir.Node] = []
        self._cut(list(graph))
        self.pos = {node: p for nodes in self.layers for p, node in enumerate(nodes)}

    def weight(self, value: ir.Value | None) -> tuple[int, str] | None:
        """(layer, rest of the name) of a layer's initializer."""
        if value is None or not value.is_initializer():
            return None
        found = self.pattern.match(value.name or "")
        return (int(found.group(1)), value.name[found.end():]) if found else None

    def where(self, value: ir.Value | None) -> tuple[int, int, int] | None:
        """(layer, position, output index) of a value a layer's node produces."""
        node = value.producer() if value is not None else None
        return (self.layer[node], self.pos[node], value.index()) if node in self.layer else None

    def _tag(self, node: ir.Node) -> int | None:
        found = self.scope.findall(node.metadata_props.get(SCOPES, ""))
        return int(found[-1]) if found else None

    def _cut(self, nodes: list[ir.Node]) -> None:
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for n in nodes
               for a in n.attributes.values()):
            raise Mismatch  # If/Loop bodies read outer values: not copied
        first, last, tags = layer_span([self._tag(n) for n in nodes])
        if set(tags[first:last + 1]) != {*range(SHALLOW)}:
            raise Mismatch  # a layer is missing
        for i, node in enumerate(nodes):
            if first <= i <= last:
                self.layer[node] = tags[i]
                self.layers[tags[i]].append(node)
            elif i > last:
                self.postlude.append(node)


def _same_attributes(a: ir.Node, b: ir.Node) -> bool:
    if a.attributes.keys() != b.attributes.keys():
        return False
    for name, x in a.attributes.items():
        y = b.attributes[name]
        if x.type != y.type:
            return False
        if isinstance(x.value, ir.TensorProtocol):
            if x.value.dtype != y.value.dtype or x.value.shape != y.value.shape or \
                    x.value.tobytes() != y.value.tobytes():
                return False
        elif x.value != y.value:
            return False
    return True


def _recipe(layout: _Layout) -> list[list[tuple]]:
    """For each template node, where each input of a copy comes from: ("shared", value), ("own", pos,
    index), ("prev", from_end, index), ("weight", rest), ("input", k) or None; Mismatch where the
    shifted layer does not say."""
    t = TEMPLATE
    template, shifted = layout.layers[t], layout.layers[t + 1]
    if len(template) != len(shifted):
        raise Mismatch
    outputs = set(layout.graph.outputs)
    recipe = []
    for a, b in zip(template, shifted):
        if (a.domain, a.op_type, a.overload, len(a.inputs), len(a.outputs)) != (
                b.domain, b.op_type, b.overload, len(b.inputs), len(b.outputs)) or not _same_attributes(a, b):
            raise Mismatch
        for value in a.outputs if a.inputs else ():  # read only by its layer, the next one and the cache outputs
            if any(layout.layer.get(user) not in (t, t + 1) for user, _ in value.uses()):
                raise Mismatch
        recipe.append(_either_order(a, b, lambda x, y: _source(layout, x, y, outputs)))
    _check_ends(layout, outputs)
    return recipe


def _source(layout: _Layout, x: ir.Value | None, y: ir.Value | None, outputs: set) -> tuple | None:
    """Where a copy's input comes from, given the template's `x` and the shifted layer's `y`."""
    t = TEMPLATE
    if x is None or y is None:
        if x is not y:
            raise Mismatch
        return None
    wx, wy = layout.where(x), layout.where(y)
    if x is y and _constant(x):
        return ("shared", x)  # the exporter writes a constant once and reuses it in later layers
    if x is y:
        if (wx and wx[0] in (t, t + 1)) or x in layout.inputs or layout.weight(x):
            raise Mismatch
        return ("shared", x)
    if wx and wy and wx[0] == t and wy[0] == t + 1 and wx[1:] == wy[1:]:
        return ("own", wx[1], wx[2])
    if wx and wy and wx[0] == t - 1 and wy[0] == t and wx[2] == wy[2] and \
            len(layout.layers[t - 1]) - wx[1] == len(layout.layers[t]) - wy[1]:
        return ("prev", len(layout.layers[t]) - wy[1], wx[2])  # counted from the end: the first layer
        # may hold a few nodes more (a cast of the embedding)
    kx, ky = layout.weight(x), layout.weight(y)
    if kx and ky and kx == (t, ky[1]) and ky[0] == t + 1 and x not in outputs:
        return ("weight", kx[1])
    ix, iy = layout.inputs.get(x), layout.inputs.get(y)
    if ix and iy and ix == (t, iy[1]) and iy[0] == t + 1:
        return ("input", ix[1])
    return ("derived", _derived(layout, x, y))


def _derived(layout: _Layout, x: ir.Value, y: ir.Value, depth: int = 0) -> tuple:
    """(node, output index, input steps) where `x` and `y` come from the same prelude nodes applied to
    the template's and the shifted layer's cache inputs: torch.export writes the past length read
    off a layer's own cache (`Shape(past_key_values.1.value)`) before the layers."""
    a, b = x.producer(), y.producer()
    if (a is None or b is None or a in layout.layer or b in layout.layer or depth > 8 or x.index() != y.index()
            or (a.domain, a.op_type, a.overload, len(a.inputs), len(a.outputs)) != (
                b.domain, b.op_type, b.overload, len(b.inputs), len(b.outputs)) or not _same_attributes(a, b)):
        raise Mismatch
    def step(u: ir.Value | None, v: ir.Value | None) -> tuple | None:
        iu, iv = layout.inputs.get(u), layout.inputs.get(v)
        if u is None or v is None:
            if u is not v:
                raise Mismatch
            return None
        if u is v and not iu and not layout.weight(u):
            return ("shared", u)
        if iu and iv and iu == (TEMPLATE, iv[1]) and iv[0] == TEMPLATE + 1:
            return ("input", iu[1])
        return ("derived", _derived(layout, u, v, depth + 1))

    return a, x.index(), _either_order(a, b, step)


def _either_order(a: ir.Node, b: ir.Node, step: Callable) -> list:
    """`step` over the inputs of `a` and `b` pairwise; for a commutative op whose operands do not
    pair in order, over `b`'s swapped (the copy keeps `a`'s order: the same value)."""
    try:
        return [step(x, y) for x, y in zip(a.inputs, b.inputs)]
    except Mismatch:
        if (a.domain, a.op_type) not in COMMUTATIVE or len(a.inputs) != 2:
            raise
        return [step(x, y) for x, y in zip(a.inputs, reversed(b.inputs))]


def _constant(value: ir.Value | None) -> bool:
    """Whether `value` comes from a node without inputs (a Constant): the same in every layer."""
    node = value.producer() if value is not None else None
    return node is not None and not node.inputs


def _check_ends(layout: _Layout, outputs: set) -> None:
    """The postlude and the shared outputs read the last layer only; the cache outputs are the
    template's and the shifted layer's nodes at the same positions."""
    last = SHALLOW - 1
    for node in layout.postlude:
        for x in node.inputs:
            w = layout.where(x)
            own_input = x in layout.inputs and layout.inputs[x][0] != 0
            if (w and w[0] != last and not _constant(x)) or own_input or layout.weight(x):
                raise Mismatch
    flat = list(layout.graph.outputs)
    lead, per = layout.lead_outputs, layout.per_output
    for x in flat[:lead]:
        w = layout.where(x)
        if (w and w[0] != last and not _constant(x)) or x in layout.inputs:
            raise Mismatch
    for k in range(per):
        mine, theirs = layout.where(flat[lead + TEMPLATE * per + k]), layout.where(flat[lead + (TEMPLATE + 1) * per + k])
        if not mine or not theirs or mine[0] != TEMPLATE or theirs[0] != TEMPLATE + 1 or mine[1:] != theirs[1:]:
            raise Mismatch
    if any(flat.count(v) > 1 for v in flat) or outputs & set(layout.inputs):
        raise Mismatch


def _weights(layout: _Layout, recipe: list[list[tuple]], depth: int,
             tensors: Callable[[str], torch.Tensor]) -> dict[str, ir.Value]:
    """The new layers' initializers, each checked against the template's dtype and shape."""
    found = {}
    for a, steps in zip(layout.layers[TEMPLATE], recipe):
        for like, step in zip(a.inputs, steps):
            if not step or step[0] != "weight":
                continue
            for i in range(SHALLOW, depth):
                name = f"{layout.prefix}{i}{step[1]}"
                if name in found:
                    continue
                try:
                    tensor = TorchTensor(tensors(name), name=name)
                except KeyError:
                    raise Mismatch from None
                if tensor.dtype != like.dtype or tuple(tensor.shape) != tuple(like.shape):
                    raise Mismatch
                found[name] = ir.Value(name=name, shape=_shape(like), type=like.type, const_value=tensor)
    if set(found) & set(layout.graph.initializers):
        raise Mismatch
    return found


class _Grower:
    """Builds the copies from the recipe and splices them in before the postlude."""

    def __init__(self, layout: _Layout, recipe: list[list[tuple]], weights: dict[str, ir.Value]):
        self.layout, self.recipe, self.weights = layout, recipe, weights
        graph = layout.graph
        self.taken = {v.name for v in graph.inputs} | set(graph.initializers) | set(weights)
        self.taken |= {v.name for node in graph for v in node.outputs}
        self.template = layout.layers[TEMPLATE]
        self.own: dict[int, list[ir.Node]] = {TEMPLATE + 1: layout.layers[TEMPLATE + 1]}  # by template position
        self.derived: dict[tuple[int, ir.Node], ir.Node] = {}

    def grow(self, depth: int) -> None:
        layout, graph = self.layout, self.layout.graph
        nodes, new_inputs = [], []
        for i in range(SHALLOW, depth):
            inputs = [self._input(i, k) for k in range(layout.per_input)]
            new_inputs += inputs
            self.own[i] = []
            for a, steps in zip(self.template, self.recipe):
                node = self._node(i, a, [self._arg(i, step, inputs, nodes) for step in steps])
                self.own[i].append(node)
                nodes.append(node)
        if layout.postlude:
            graph.insert_before(layout.postlude[0], nodes)
        else:
            graph.extend(nodes)
        last = self.own[depth - 1]
        for node in layout.postlude:
            for index, x in enumerate(node.inputs):
                w = layout.where(x)
                if w and w[0] == SHALLOW - 1:
                    node.replace_input_with(index, last[w[1]].outputs[w[2]])
        flat = list(graph.outputs)
        lead, per = layout.lead_outputs, layout.per_output
        for index, x in enumerate(flat[:lead]):
            w = layout.where(x)
            if w and w[0] == SHALLOW - 1:
                graph.outputs[index] = last[w[1]].outputs[w[2]]
        cache = [layout.where(flat[lead + TEMPLATE * per + k]) for k in range(per)]
        for i in range(SHALLOW, depth):
            graph.outputs.extend(self.own[i][p].outputs[k] for _, p, k in cache)
        graph.inputs.extend(new_inputs)
        for value in self.weights.values():
            graph.register_initializer(value)

    def _arg(self, i: int, step: tuple | None, inputs: list[ir.Value], nodes: list[ir.Node]) -> ir.Value | None:
        """Layer i's value for one input step of the recipe (derived prelude nodes appended to `nodes`)."""
        kind = step[0] if step else None
        if kind is None:
            return None
        if kind == "shared":
            return step[1]
        if kind == "own":
            return self.own[i][step[1]].outputs[step[2]]
        if kind == "prev":
            prev = self.own[i - 1]
            return prev[len(prev) - step[1]].outputs[step[2]]
        if kind == "weight":
            return self.weights[f"{self.layout.prefix}{i}{step[1]}"]
        if kind == "input":
            return inputs[step[1]]
        node, index, steps = step[1]  # a prelude node on this layer's cache inputs, copied once per layer
        if (i, node) not in self.derived:
            self.derived[(i, node)] = self._node(i, node, [self._arg(i, s, inputs, nodes) for s in steps])
            nodes.append(self.derived[(i, node)])
        return self.derived[(i, node)].outputs[index]

    def _node(self, i: int, a: ir.Node, args: list) -> ir.Node:
        node = ir.Node(a.domain, a.op_type, args, a.attributes.values(), overload=a.overload,
                       num_outputs=len(a.outputs), version=a.version, name=self._name(a.name or a.op_type, i),
                       metadata_props=self._moved(a.metadata_props, i))
        for out, like in zip(node.outputs, a.outputs):
            out.name, out.shape, out.type = self._name(like.name or "v", i), _shape(like), like.type
        return node

    def _name(self, stem: str, i: int) -> str:
        name, n = f"{stem}__layer{i}", 0
        while name in self.taken:
            n += 1
            name = f"{stem}__layer{i}_{n}"
        self.taken.add(name)
        return name

    def _input(self, i: int, k: int) -> ir.Value:
        like = next(v for v, key in self.layout.inputs.items() if key == (TEMPLATE, k))
        return ir.Value(name=self._name(like.name or "past", i), shape=_shape(like), type=like.type)

    def _moved(self, props, i: int) -> dict[str, str]:
        """The node's metadata with the template layer's module paths moved to layer i."""
        pattern = re.compile(re.escape(self.layout.prefix) + str(TEMPLATE) + r"(?=[.'/:\s]|$)")
        return {k: pattern.sub(f"{self.layout.prefix}{i}", v) if k in _SCOPED else v for k, v in props.items()}


def _shape(value: ir.Value) -> ir.Shape | None:
    return value.shape.copy() if value.shape is not None else None
