"""The framework-neutral graph view that chain analysis runs on.

Frontends (fx, ONNX) emit `ViewNode`s in topological order; `build_view` turns them into a
networkx DiGraph whose node attributes are the only facts the analysis reads:

    kind     one of the `Kind` values below
    target   a readable op name ("aten.layer_norm", "Add", ...)
    inputs   ordered names of the tensor-valued inputs (no literals)
    users    names of the consumers, with multiplicity, in graph order
    shape    tuple of int (static) or str (symbolic) dims, or None if unknown
    dtype    str or None
    order    topological index
    const    True when no graph input reaches the node (parameters, buffers, folded tables)
    scalar   ADD only: True when one operand is a literal scalar
    blocker  ADD only: a frontend's reason why this add can never be a residual link
             (alpha != 1, an in-place add whose operand is read again), else None
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


def build_view(nodes: list[ViewNode]) -> nx.DiGraph:
    """DiGraph of `nodes` (given in topological order) with users, order and const filled in."""
    g = nx.DiGraph()
    for order, n in enumerate(nodes):
        const = n.kind == Kind.CONST or (
            n.kind != Kind.INPUT and all(g.nodes[i]["const"] for i in n.inputs)
        )
        g.add_node(
            n.name, kind=n.kind, target=n.target, inputs=list(n.inputs), users=[], shape=n.shape,
            dtype=n.dtype, order=order, const=const, scalar=n.scalar, blocker=n.blocker,
        )
        for i in n.inputs:
            g.add_edge(i, n.name)
            g.nodes[i]["users"].append(n.name)
    return g


def dynamic_inputs(g: nx.DiGraph, name: str) -> list[str]:
    """The inputs of `name` that carry data from a graph input (not parameters or constants)."""
    return [i for i in g.nodes[name]["inputs"] if not g.nodes[i]["const"]]
