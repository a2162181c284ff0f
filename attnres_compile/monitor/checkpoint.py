"""`inspect_weights`: the depth-attention stats of a saved rewritten `.pt2` (`inspect --weights`),
measured on its stored example inputs unless others are given.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import fx

from ..core.errors import InputError, first_line
from ..ops.depth_attention import depth_attention
from .collapse import find_collapse
from .watch import DepthMonitor


def load_checkpoint(path: str | Path) -> tuple[fx.GraphModule, tuple, dict]:
    """The rewritten GraphModule of a `.pt2` torch.export program and the example (args, kwargs) stored
    with it, read without running anything stored in the archive (pt2.load)."""
    from ..pt2 import load

    ep = load(path).program
    args, kwargs = ep.example_inputs if ep.example_inputs is not None else (None, None)
    return ep.module(), args, kwargs or {}


def inspect_weights(checkpoint: str | Path, out: str | Path | None = None, inputs: tuple | None = None,
                    min_entropy: float = 0.1, dead_weight: float = 1e-3) -> dict:
    """Depth-attention stats of a saved rewritten model (`.pt2`), measured on `inputs` (positional
    args) or the program's stored example inputs; writes the heatmap PNG to `out` when given.

    Returns {"checkpoint", "stats", "collapse"[, "heatmap"]}.
    """
    gm, args, kwargs = load_checkpoint(checkpoint)
    if inputs is not None:
        args, kwargs = tuple(inputs), {}
    if args is None:
        raise InputError(f"{checkpoint} stores no example inputs to measure the weights on: pass inputs, or write "
                         "it with `attnres-compile rewrite -o X.pt2`")
    if not any(n.op == "call_function" and n.target is depth_attention for n in gm.graph.nodes):
        raise InputError(f"{checkpoint} holds no depth-attention site: rewrite the model first "
                         "(`attnres-compile rewrite -o X.pt2`)")
    monitor = DepthMonitor(gm)
    try:
        with torch.no_grad():
            monitor(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a damaged archive whose program fails on its own inputs
        raise InputError(f"the program in {checkpoint} fails on its example inputs ({first_line(exc)})") from None
    stats = monitor.stats()
    result = {"checkpoint": str(checkpoint), "stats": stats, "collapse": find_collapse(stats, min_entropy, dead_weight)}
    if out is not None:
        from ..utils.plots import plot_heatmap

        result["heatmap"] = str(plot_heatmap(stats, out, title=Path(checkpoint).name))
    return result
