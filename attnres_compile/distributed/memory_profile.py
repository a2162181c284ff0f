"""What one micro-batch of a model costs in memory, measured once in one process: the planner's input.

`profile_model` runs the traced original once, forward and backward, on one micro-batch under
`LiveBytes`, which attributes every storage torch makes to the layer whose node made it: per
decoder layer, parameter bytes, the bytes kept for backward, and what crosses each boundary
besides the stream (masks, rotary tables). Measured, because they depend on the model's
internals; what the rewrite adds is the planner's arithmetic. Layers are found as `split_stages`
finds blocks (pipeline._blocks).
"""

from __future__ import annotations

import gc
import inspect
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import fx
from torch.nn import functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from ..core.errors import ConfigError
from .pipeline import _assign, _blocks, _carried, block_starts


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages alive, counted as torch ops make them (each storage once), on any
    device, CPU included. Storages from before count once passed to `track`. `part` labels new
    storages (`by_part` sums the live ones); `peak` is the most alive since `reset_peak`, less
    `discount`."""

    def __init__(self):
        super().__init__()
        self._seen = WeakIdKeyDictionary()
        self.live = self.peak = self.discount = 0
        self.part: Any = None
        self.by_part: dict[Any, int] = {}

    def track(self, *tensors: Any) -> None:
        for t in pytree.tree_leaves(tensors):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            size = storage.nbytes()
            if size == 0 or storage in self._seen:
                continue
            self._seen[storage] = True
            self.live += size
            self.by_part[self.part] = self.by_part.get(self.part, 0) + size
            weakref.finalize(storage, self._free, size, self.part)
        self.peak = max(self.peak, self.live - self.discount)

    def _free(self, size: int, part: Any) -> None:
        self.live -= size
        self.by_part[part] -= size

    def reset_peak(self) -> None:
        self.peak = self.live - self.discount

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(out)
        return out


@dataclass
class Boundary:
    """What crosses the cut before layer `layer` besides the residual stream: (name, bytes, the
    index of the part that made it: 0 before the first layer, i + 1 in layer i)."""

    layer: int
    other: list[tuple[str, int, int]]

    @property
    def other_bytes(self) -> int:
        return sum(b for _, b, _ in self.other)


@dataclass
class Profile:
    """One micro-batch, measured: `parts[0]` is what runs before the first layer, `parts[i + 1]` layer i
    up to the next (the last: final norm, head and loss). Per part in bytes: `params`, `buffers`,
    `held` (alive from forward to backward); `transient` / `transient_head`: backward's peak above the
    forward's leftovers after / before the last layer; `links[i]`: layer i's residual links;
    `outputs`: the model outputs' bytes."""

    layers: list[str]
    params: list[int]
    buffers: list[int]
    held: list[int]
    links: list[int]
    boundaries: list[Boundary]
    transient: int
    transient_head: int
    outputs: int
    width: int
    itemsize: int
    dtype: str
    tokens: int
    loss: str
    notes: list[str] = field(default_factory=list)

    @property
    def stream(self) -> int:
        """Bytes of one [tokens, width] value: the stream, one source, one block sum."""
        return self.tokens * self.width * self.itemsize

    def to_dict(self) -> dict:
        return {**asdict(self), "stream": self.stream}


def profile_model(gm: fx.GraphModule, args: tuple, kwargs: dict, chain: dict) -> Profile:
    """Measure `gm` (a traced model, `api.trace(...).graph_module`) on one micro-batch
    (`args`/`kwargs`), its layers found by `chain` (a chain of the analysis report, the residual
    stream to rewrite). The loss is cross-entropy on the first floating output (its last axis the
    classes), as a language model's; a sum for an output of one axis."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    by_name = {n.name: n for n in nodes}
    adds = [by_name[a] for link in chain["detail"] for a in link["adds"] if a in by_name]
    layers, layer_of = _blocks(nodes, set(adds))
    first = block_starts(nodes, layer_of)
    part_of = _assign(nodes, first, layers)  # 0: before layer 0; i + 1: layer i and what follows it
    links = [sum(part_of[by_name[link["adds"][0]]] == i + 1 for link in chain["detail"]) for i in range(len(layers))]
    params, buffers, tied = _weights(gm, part_of, len(layers) + 1)
    held, (transient, transient_head), outputs, sizes, loss = _run(gm, args, kwargs, part_of, len(layers),
                                                                   chain["detail"][-1]["result"])
    stream_names = {name for link in chain["detail"] for name in (link["result"], link["skip"])}
    boundaries = []
    for j in range(1, len(layers)):
        crossing = _carried(gm.graph, _assign(nodes, first, [layers[j]]), 2)[0]
        boundaries.append(Boundary(j, [(n.name, sizes[n.name], part_of.get(n, 0)) for n in crossing
                                       if n.name not in stream_names and sizes.get(n.name)]))
    width = int(chain["feature_size"])
    first_site = by_name[chain["detail"][0]["result"]]  # one value of the stream: [tokens, width] in its dtype
    meta = first_site.meta["val"]
    itemsize = meta.element_size()
    tokens = sizes[first_site.name] // (width * itemsize)
    dtype = str(meta.dtype).removeprefix("torch.")
    notes = [f"{name} is read by two parts of the model (tied weights), counted once where first read: split_stages "
             f"refuses it when the stages part it; untie it (e.g. tie_word_embeddings=False)" for name in tied]
    return Profile(layers, params, buffers, held, links, boundaries, transient, transient_head, outputs, width, itemsize,
                   dtype, tokens, loss, notes)


def _weights(gm: fx.GraphModule, part_of: dict[fx.Node, int], count: int) -> tuple[list[int], list[int], list[str]]:
    """Parameter and buffer bytes per part, each weight in the part of its first reader; and the
    parameters read by more than one part (tied weights)."""
    params, buffers = [0] * count, [0] * count
    named_params = dict(gm.named_parameters(remove_duplicate=False))
    named_buffers = dict(gm.named_buffers())
    readers: dict[int, tuple[str, set[int]]] = {}
    for node in gm.graph.nodes:
        tensor = named_params.get(node.target, named_buffers.get(node.target)) if node.op == "get_attr" else None
        if tensor is None or not node.users:
            continue
        parts = {part_of.get(u, count - 1) for u in node.users}
        if id(tensor) not in readers:
            (params if node.target in named_params else buffers)[min(parts)] += tensor.numel() * tensor.element_size()
        readers.setdefault(id(tensor), (node.target, set()))[1].update(parts)
    return params, buffers, [name for name, parts in readers.values() if len(parts) > 1 and name in named_params]


class _Attributing(fx.Interpreter):
    """Runs the graph with `mode.part` set to the part of the node being run; `on_grad` is called
    when backward has computed the gradient of node `mark`'s value."""

    def __init__(self, gm: fx.GraphModule, part_of: dict[fx.Node, int], mode: LiveBytes, sizes: dict[str, int],
                 mark: str, on_grad):
        super().__init__(gm)
        self.part_of, self.mode, self.sizes, self.mark, self.on_grad = part_of, mode, sizes, mark, on_grad

    def run_node(self, n: fx.Node) -> Any:
        self.mode.part = self.part_of.get(n, self.mode.part)
        out = super().run_node(n)
        if n.name == self.mark and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self.on_grad)
        leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.sizes[n.name] = sum(t.numel() * t.element_size() for t in leaves)
        return out


def _run(gm: fx.GraphModule, args: tuple, kwargs: dict, part_of: dict[fx.Node, int], layers: int, last: str):
    """(held bytes per part, backward transients (through the layers; through what follows node
    `last`, the stream out of the last layer: final norm, head, loss), the outputs' bytes, output
    bytes per node name, the loss's name)."""
    bound = inspect.signature(gm.forward).bind(*args, **kwargs).arguments
    flat = pytree.tree_leaves(bound)
    weights = [*gm.parameters(), *gm.buffers()]
    grads = [p for p in gm.parameters() if p.requires_grad]
    if not grads:
        raise ConfigError("the model has no trainable parameters: nothing to plan training memory for")
    sizes: dict[str, int] = {}
    mode = LiveBytes()
    mode.part = "weights"
    mode.track(weights, [t for t in flat if isinstance(t, torch.Tensor)])
    with torch.enable_grad(), mode:
        mode.part = 0
        head: list[int] = []  # the head's peak, and the level when backward enters the last layer

        def layers_begin(grad):
            head.extend([mode.peak, mode.live - mode.discount])
            mode.reset_peak()

        out = _Attributing(gm, part_of, mode, sizes, last, layers_begin).run(*flat)
        mode.part = layers
        leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        outputs = sum(t.numel() * t.element_size() for t in leaves)
        logits = next(t for t in leaves if t.is_floating_point())
        if logits.dim() >= 2:
            classes = torch.zeros(logits.shape[:-1].numel(), dtype=torch.long)
            loss = F.cross_entropy(logits.flatten(0, -2).float(), classes)
            name = "cross-entropy on the first floating output"
        else:
            loss, name = logits.float().sum(), "sum of the first floating output"
        del out, logits, leaves
        gc.collect()
        held = [mode.by_part.get(i, 0) for i in range(layers + 1)]
        after_forward = mode.live
        count_grad = lambda p: setattr(mode, "discount", mode.discount + p.grad.nbytes)  # noqa: E731
        hooks = [p.register_post_accumulate_grad_hook(count_grad) for p in grads]
        mode.reset_peak()
        loss.backward()
        for h in hooks:
            h.remove()
    if not head:  # the stream's last value does not reach the loss: one phase
        head = [mode.peak, after_forward]
    transient, through_head = max(0, mode.peak - head[1]), max(0, head[0] - after_forward)
    for p in grads:
        p.grad = None
    return held, (transient, through_head), outputs, sizes, name
