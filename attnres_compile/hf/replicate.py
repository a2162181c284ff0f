"""A deep decoder traced as a shallow one: three layers traced, the middle layer copied for the rest.

torch.export's symbolic tracing costs about 0.7 s a layer of SmolLM2 (25 s of a 30-layer model's
conversion); the analysis and the rewrite after it take well under a second. So `trace_layers`
traces a meta-device instance of the backbone's class with `SHALLOW` layers and `deepen` grows the
graph to the backbone's depth before the analysis reads it. A layer is copied only where nothing
tells it apart: every layer of the backbone has the template's modules, parameter shapes and plain
attributes (the layer's own index aside), and in the trace the last layer is the middle one
shifted by one — the same ops with the same constants, reading the middle layer where the middle
reads the first, the same shared values (masks, rotary tables) and its own weights and cache
inputs. Anything else (sliding and full layers mixed, GPT-2's 1/(layer+1) scaling, a layer that
reads two layers back) gives None and the caller traces the whole model.
"""

from __future__ import annotations

import copy
import re

from torch import fx, nn
from torch.utils import _pytree as pytree

from ..core.replicate import SHALLOW, TEMPLATE, Mismatch, layer_span
from .classes import base_class

_SIMPLE = (bool, int, float, str, type(None))


def shallow_config(config, depth: int = SHALLOW):
    """A copy of an HF config with `depth` layers; per-layer lists (layer_types, ...) cut to `depth`."""
    layers = config.num_hidden_layers
    short = copy.deepcopy(config)
    short.num_hidden_layers = depth
    for name, value in vars(config).items():
        if isinstance(value, (list, tuple)) and len(value) == layers and not name.startswith("_"):
            setattr(short, name, type(value)(value[:depth]))
    return short


def layers_path(backbone: nn.Module) -> str | None:
    """The backbone's decoder layers: its longest ModuleList child (`layers`, `h`, ...)."""
    lists = [(len(m), name) for name, m in backbone.named_children() if isinstance(m, nn.ModuleList) and len(m)]
    return max(lists)[1] if lists else None


def shallow_view(lm: nn.Module) -> tuple[nn.Module, str] | str | None:
    """(`lm` seen with its first SHALLOW layers, the layers' module prefix in it); None where it has
    SHALLOW layers or fewer, or why its layers are not all alike. The view shares every module and
    tensor with `lm` (nothing is copied) and computes the user's original function: a converted
    model's modules are seen as their own classes, without the depth-attention parameters.
    onnx/replicate.py grows its export."""
    backbone = lm.get_decoder()
    path = next((name for name, m in lm.named_modules() if m is backbone), None)
    name = layers_path(backbone)
    config = getattr(backbone, "config", None)
    if path is None or name is None or config is None or len(backbone.get_submodule(name)) <= SHALLOW:
        return None
    layers = backbone.get_submodule(name)
    if getattr(config, "num_hidden_layers", None) != len(layers) or not _uniform(config, len(layers)):
        return "its config sets the layers apart (per-layer settings that differ)"
    if not same_layers(layers, layers[TEMPLATE]):
        return "its layers are not all alike (their modules, shapes or settings differ)"
    short = shallow_config(config)
    top = _view(lm, config, short)
    parent = top
    for part in path.split(".") if path else []:
        parent._modules[part] = _view(parent._modules[part], config, short)
        parent = parent._modules[part]
    parent._modules.pop("attnres", None)
    parent._modules[name] = nn.ModuleList([_view(layer, config, short) for layer in list(layers)[:SHALLOW]])
    return top, f"{path}.{name}." if path else f"{name}."


def _view(module: nn.Module, config, short) -> nn.Module:
    """`module` as an instance of its user's class with its own dict of children (so that a child can be
    swapped in the view alone); a `config` attribute that is the model's config becomes `short`."""
    view = object.__new__(base_class(module))
    view.__dict__.update(module.__dict__)
    view.__dict__["_modules"] = dict(module._modules)
    if module.__dict__.get("config") is config:
        view.__dict__["config"] = short
    return view


def _uniform(config, layers: int) -> bool:
    """Whether every per-layer list of `config` (layer_types, ...) holds one value."""
    return all(len(set(map(repr, value))) <= 1 for key, value in vars(config).items()
               if isinstance(value, (list, tuple)) and len(value) == layers and not key.startswith("_"))


def same_layers(layers: nn.ModuleList, template: nn.Module) -> bool:
    """Whether every module of `layers` looks like `template` (layer TEMPLATE of the shallow model):
    the same modules, tensor shapes and dtypes, and plain attributes, an attribute holding the
    layer's own index (`layer_idx`) aside."""
    want = _signature(template)
    return all(_alike(_signature(layer), want, i) for i, layer in enumerate(layers))


def _signature(layer: nn.Module) -> list:
    return [(name, type(module).__qualname__,
             {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training" and _plain(v)},
             [(n, tuple(t.shape), t.dtype) for n, t in [*module.named_parameters(recurse=False),
                                                         *module.named_buffers(recurse=False)]])
            for name, module in layer.named_modules()]


def _alike(got: list, want: list, index: int) -> bool:
    if len(got) != len(want):
        return False
    for (name, cls, attrs, tensors), (name_, cls_, attrs_, tensors_) in zip(got, want):
        if (name, cls, tensors) != (name_, cls_, tensors_) or attrs.keys() != attrs_.keys():
            return False
        for key, value in attrs.items():
            own_index = type(value) is int and value == index and attrs_[key] == TEMPLATE
            if value != attrs_[key] and not own_index:
                return False
    return True


def _plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, _SIMPLE) for v in value)
    return isinstance(value, _SIMPLE)


def deepen(gm: fx.GraphModule, prefix: str, depth: int, lead_inputs: int, lead_outputs: int) -> bool:
    """Grow `gm`, a trace of a `SHALLOW`-layer decoder whose layer i lives under `<prefix><i>`, to
    `depth` layers in place; False (gm untouched) where its last layer is not its template shifted.
    Inputs: `lead_inputs` shared ones, then the same number per layer (its KV cache); outputs
    likewise after `lead_outputs`."""
    try:
        layout = _Layout(gm.graph, prefix, lead_inputs, lead_outputs)
        new = _grow(layout, depth)
    except Mismatch:
        return False
    holder = gm.get_submodule(prefix.rstrip("."))
    for i in range(SHALLOW, depth):  # meta tensors: the copies cost nothing
        holder.register_module(str(i), copy.deepcopy(holder.get_submodule(str(TEMPLATE))))
    if getattr(gm.graph._codegen, "pytree_info", None) is not None:  # the call takes the new inputs
        names = [n.name for n in new.find_nodes(op="placeholder")]
        outputs = next(iter(new.find_nodes(op="output"))).args[0]
        new._codegen = fx.graph._PyTreeCodeGen(fx.graph._PyTreeInfo(
            names, pytree.tree_flatten((tuple(names), {}))[1], pytree.tree_flatten(tuple(outputs))[1]))
    gm.graph = new
    return True


class _Layout:
    """The shallow trace cut into shared inputs, per-layer inputs, prelude, layers and postlude."""

    def __init__(self, graph: fx.Graph, prefix: str, lead_inputs: int, lead_outputs: int):
        self.graph, self.prefix = graph, prefix
        self.pattern = re.compile(re.escape(prefix) + r"(\d+)(?=\.|$)")
        inputs = graph.find_nodes(op="placeholder")
        per, extra = divmod(len(inputs) - lead_inputs, SHALLOW)
        if extra or per < 0:
            raise Mismatch
        self.per_input = per
        self.inputs = {node: (i // per, i % per) for i, node in enumerate(inputs[lead_inputs:])} if per else {}
        self.input_of = {key: node for node, key in self.inputs.items()}
        self.output = next(iter(graph.find_nodes(op="output")))
        flat = self.output.args[0]
        if not isinstance(flat, (tuple, list)) or (len(flat) - lead_outputs) % SHALLOW:
            raise Mismatch
        self.lead_outputs = lead_outputs
        self.per_output = (len(flat) - lead_outputs) // SHALLOW
        self.layer: dict[fx.Node, int] = {}
        self.layers: list[list[fx.Node]] = [[] for _ in range(SHALLOW)]
        self.prelude: list[fx.Node] = []
        self.postlude: list[fx.Node] = []
        self._cut([n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")])
        self.pos = {node: p for nodes in self.layers for p, node in enumerate(nodes)}

    def back(self, node: fx.Node) -> int:
        """`node`'s position in its layer, counted from the end."""
        return len(self.layers[self.layer[node]]) - self.pos[node]

    def attr_layer(self, node: fx.Node) -> tuple[int, str] | None:
        found = self.pattern.match(node.target) if node.op == "get_attr" else None
        return (int(found.group(1)), node.target[found.end():]) if found else None

    def _tag(self, node: fx.Node) -> int | None:
        stack = node.meta.get("nn_module_stack") or {}
        for path, _ in reversed(list(stack.values())):
            found = self.pattern.match(path) if isinstance(path, str) else None
            if found:
                return int(found.group(1))
        return None

    def _cut(self, calls: list[fx.Node]) -> None:
        first, last, tags = layer_span([self._tag(n) for n in calls])
        for i, node in enumerate(calls):
            if node.op == "call_module" and node.target == "_guards_fn":
                continue  # torch.export's input checks: the outline drops them
            if i < first:
                self.prelude.append(node)
            elif i > last:
                self.postlude.append(node)
            else:
                self.layer[node] = tags[i]
                self.layers[tags[i]].append(node)


def _walk(a, b, leaf):
    """`a`'s argument structure with each Node pair (x from a, y from b) replaced by leaf(x, y);
    Mismatch where the structures or the plain values differ."""
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            raise Mismatch
        return leaf(a, b)
    if type(a) is not type(b):
        raise Mismatch
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            raise Mismatch
        items = [_walk(x, y, leaf) for x, y in zip(a, b)]
        return type(a)(items) if not hasattr(a, "_fields") else type(a)(*items)
    if isinstance(a, dict):
        if a.keys() != b.keys():
            raise Mismatch
        return {k: _walk(a[k], b[k], leaf) for k in a}
    if isinstance(a, slice):
        return slice(*(_walk(x, y, leaf) for x, y in ((a.start, b.start), (a.stop, b.stop), (a.step, b.step))))
    if a != b and not (isinstance(a, float) and a != a and b != b):
        raise Mismatch
    return a


def _grow(layout: _Layout, depth: int) -> fx.Graph:
    """The graph with layers TEMPLATE + 1 .. depth - 1 copied from the template, the shifted layer
    telling which reads move with the layer."""
    t = TEMPLATE
    template, shifted = layout.layers[t], layout.layers[t + 1]
    if len(template) != len(shifted) or any(
            a.op != b.op or a.target != b.target for a, b in zip(template, shifted)):
        raise Mismatch
    for node in template:  # read only by its layer, the next one and the cache outputs
        if any(u is not layout.output and layout.layer.get(u) not in (t, t + 1) for u in node.users):
            raise Mismatch
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attrs: dict[str, fx.Node] = {}
    inputs: dict[tuple[int, int], fx.Node] = {}
    grown: list[list[fx.Node]] = []

    def copied(x: fx.Node) -> fx.Node:
        if x not in env:
            raise Mismatch
        return env[x]

    def attr(i: int, rest: str, like: fx.Node) -> fx.Node:
        target = f"{layout.prefix}{i}{rest}"
        if target not in attrs:
            with graph.inserting_before(next(iter(graph.find_nodes(op="placeholder")))):
                attrs[target] = graph.get_attr(target)
            attrs[target].meta.update(like.meta)
        return attrs[target]

    def layer_node(i: int, p: int) -> fx.Node:
        return env[template[p]] if i == t else grown[i - t - 1][p]

    def shift(i: int):
        """leaf(x, y) for copy i: x read by the template, y by the shifted layer."""
        def leaf(x: fx.Node, y: fx.Node) -> fx.Node:
            if x is y and layout.layer.get(x) not in (t, t + 1) and x not in layout.inputs and x.op != "get_attr":
                return copied(x)  # a shared value
            if layout.layer.get(x) == t and layout.layer.get(y) == t + 1 and layout.pos[x] == layout.pos[y]:
                return grown[i - t - 1][layout.pos[x]]
            if layout.layer.get(x) == t - 1 and layout.layer.get(y) == t and layout.back(x) == layout.back(y):
                return layer_node(i - 1, len(template) - layout.back(x))  # counted from the end: the first
                # layer may hold a few calls more (a cast of the embedding)
            ax, ay = layout.attr_layer(x), layout.attr_layer(y)
            if ax and ay and ax == (t, ay[1]) and ay[0] == t + 1:
                return attr(i, ax[1], x)
            kx, ky = layout.inputs.get(x), layout.inputs.get(y)
            if kx and ky and kx == (t, ky[1]) and ky[0] == t + 1:
                return inputs[(i, kx[1])]
            if x is y and x.op == "get_attr":
                return copied(x)
            raise Mismatch
        return leaf

    for node in layout.graph.find_nodes(op="get_attr"):
        found = layout.attr_layer(node)
        if found is None or found[0] <= t:
            env[node] = graph.get_attr(node.target)
            env[node].meta.update(node.meta)
            if found:
                attrs[node.target] = env[node]
    for node in layout.graph.find_nodes(op="placeholder"):
        env[node] = graph.node_copy(node, copied)
        key = layout.inputs.get(node)
        if key:
            inputs[key] = env[node]
    for i in range(SHALLOW, depth):
        for k in range(layout.per_input):
            like = layout.input_of[(t, k)]
            stem = re.sub(r"_\d+$", "", like.name)
            inputs[(i, k)] = graph.placeholder(f"{stem}_{i * layout.per_input + k}")
            inputs[(i, k)].meta.update(like.meta)
    for node in layout.prelude + [n for i in range(t + 1) for n in layout.layers[i]]:
        env[node] = graph.node_copy(node, copied)
    for i in range(t + 1, depth):  # the template for layers t+1 .. depth-1, reads shifted
        leaf = shift(i)
        grown.append([])
        for a, b in zip(template, shifted):
            new = graph.create_node(a.op, a.target, _walk(a.args, b.args, leaf), _walk(a.kwargs, b.kwargs, leaf),
                                    type_expr=a.type)
            new.meta.update(a.meta)
            new.meta["nn_module_stack"] = _moved(a.meta.get("nn_module_stack"), layout.prefix, t, i)
            grown[-1].append(new)

    def after(x: fx.Node) -> fx.Node:
        if layout.layer.get(x) == SHALLOW - 1:
            return grown[-1][layout.pos[x]]
        if x in layout.layer or layout.inputs.get(x, (0,))[0] > t:
            raise Mismatch  # the postlude reads a layer other than the last
        return copied(x)

    for node in layout.postlude:
        env[node] = graph.node_copy(node, after)
    flat = layout.output.args[0]
    lead, per = layout.lead_outputs, layout.per_output
    mine = [flat[lead + t * per + k] for k in range(per)]  # the template's cache outputs
    theirs = [flat[lead + (t + 1) * per + k] for k in range(per)]
    if any(layout.layer.get(x) != t or layout.layer.get(y) != t + 1 or layout.pos[x] != layout.pos[y]
           for x, y in zip(mine, theirs)):
        raise Mismatch
    outs = [after(x) if isinstance(x, fx.Node) else x for x in flat[:lead]]
    outs += [copied(x) for x in flat[lead:lead + (t + 1) * per]]
    for layer in grown:
        outs += [layer[layout.pos[x]] for x in mine]
    graph.output(tuple(outs))
    graph.lint()
    return graph


def _moved(stack: dict | None, prefix: str, old: int, new: int) -> dict | None:
    """An nn_module_stack with layer `old`'s paths and keys moved to layer `new`."""
    if not stack:
        return stack
    pattern = re.compile(re.escape(prefix) + str(old) + r"(?=\.|$)")
    return {pattern.sub(f"{prefix}{new}", key): (pattern.sub(f"{prefix}{new}", value[0]), *value[1:])
            for key, value in stack.items()}
