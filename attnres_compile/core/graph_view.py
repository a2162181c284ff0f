"""The framework-neutral graph view that chain analysis runs on.

Frontends (fx, ONNX) emit `ViewNode`s in topological order; `build_view` turns them into a
networkx DiGraph whose node attributes are the only facts the analysis reads:
kind (`Kind`), target (readable op name), inputs (tensor-valued inputs, in order), users
(consumers with multiplicity, in graph order), shape (int or symbolic-str dims, or None), dtype,
order (topological index), const (no graph input reaches it), scalar (ADD: one operand a literal),
blocker (ADD: why it can never be a residual link, e.g. an in-place add whose operand is read
again; else None), learned (a contraction, or an op reading a floating constant of more than one
element: a residual branch passes through one, GELU-tanh's internal sums do not) and
mode_dependent (PASSTHROUGH: identity in eval only, like dropout; sums are not flattened through it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import networkx as nx


class Kind(str, Enum):
    INPUT = "input"                  # a graph input
    CONST = "const"                  # parameter, buffer, initializer, constant
    ADD = "add"                      # elementwise add (possibly in place)
    PASSTHROUGH = "passthrough"      # value-preserving: same-dtype cast, identity, clone, eval dropout
    LAYOUT = "layout"                # view/reshape that keeps the last (feature) axis whole
    DEPTH_ATTENTION = "depth_attention"  # an AttnRes site already in the graph
    OP = "op"                        # anything else
    OUTPUT = "output"                # the graph's output sink


@dataclass
class ViewNode:
    name: str
    kind: Kind
    target: str
    inputs: list[str] = field(default_factory=list)
    shape: tuple | None = None
    dtype: str | None = None
    scalar: bool = False
    blocker: str | None = None
    learned: bool = False
    mode_dependent: bool = False


def _is_weight(d: dict) -> bool:
    """A constant that can be a learned weight: floating (or of unknown type), more than one element."""
    floating = d["dtype"] is None or any(t in d["dtype"] for t in ("float", "double"))
    shape = d["shape"]
    if shape is None:
        return floating
    size = 1
    for dim in shape:
        if not isinstance(dim, int):
            return False
        size *= dim
    return floating and size > 1


def build_view(nodes: list[ViewNode]) -> nx.DiGraph:
    """DiGraph of `nodes` (given in topological order) with users, order, const and learned filled in."""
    g = nx.DiGraph()
    for order, n in enumerate(nodes):
        const = n.kind == Kind.CONST or (
            n.kind != Kind.INPUT and all(g.nodes[i]["const"] for i in n.inputs)
        )
        learned = not const and n.kind not in (Kind.INPUT, Kind.OUTPUT) and (
            n.learned or any(g.nodes[i]["const"] and _is_weight(g.nodes[i]) for i in n.inputs)
        )
        g.add_node(
            n.name, kind=n.kind, target=n.target, inputs=list(n.inputs), users=[], shape=n.shape,
            dtype=n.dtype, order=order, const=const, scalar=n.scalar, blocker=n.blocker,
            learned=learned, mode_dependent=n.mode_dependent,
        )
        for i in n.inputs:
            g.add_edge(i, n.name)
            g.nodes[i]["users"].append(n.name)
    return g


def format_shape(shape: tuple | None, width: int = 100) -> str:
    """A shape for a one-line message: each symbolic dim up to 24 characters, the whole up to `width`."""
    if shape is None:
        return "unknown"
    dims = [d if isinstance(d, int) or len(str(d)) <= 24 else f"{str(d)[:21]}..." for d in shape]
    text = "[" + ", ".join(map(str, dims)) + "]"
    return text if len(text) <= width else text[: width - 4] + "...]"


def dynamic_inputs(g: nx.DiGraph, name: str) -> list[str]:
    """The inputs of `name` that carry data from a graph input (not parameters or constants)."""
    return [i for i in g.nodes[name]["inputs"] if not g.nodes[i]["const"]]
