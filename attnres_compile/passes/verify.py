"""Numerical verification: original against rewritten outputs on the same inputs, per output."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

ATOL = 1e-5   # preserve mode, fp32: the rewrite only reassociates a sum
RTOL = 1e-5
PAPER_TOL = 1e-3  # paper mode on PreNorm models differs through the norms' eps only (abs and rel)


def tolerance(scale: str, changes_function: bool) -> tuple[float | None, float]:
    """(atol, rtol) of the verdict for a rewrite: none (None) when it changes the function."""
    if changes_function:
        return None, RTOL
    if scale == "preserve":
        return ATOL, RTOL
    return PAPER_TOL, PAPER_TOL


def compare(expected: Any, actual: Any, atol: float | None, rtol: float = RTOL) -> list[dict]:
    """Per floating output leaf: max abs error, max rel error (max abs / max |ref|), and whether max_abs <= atol + rtol*max|ref|.

    `atol=None` reports the errors without a verdict (the rewrite changes the function).
    """
    exp_leaves, exp_spec = pytree.tree_flatten_with_path(expected)
    act_leaves, act_spec = pytree.tree_flatten_with_path(actual)
    if len(exp_leaves) != len(act_leaves):
        return [{"output": "<structure>", "ok": False, "error": f"{len(exp_leaves)} outputs before, {len(act_leaves)} after"}]
    rows = []
    for (path, ref), (_, got) in zip(exp_leaves, act_leaves):
        if not isinstance(ref, torch.Tensor) or not ref.is_floating_point():
            continue
        name = pytree.keystr(path) or "output"
        ref64, got64 = ref.detach().double(), got.detach().double()
        if ref64.shape != got64.shape:
            rows.append({"output": name, "ok": False, "error": f"shape {list(ref.shape)} became {list(got.shape)}"})
            continue
        diff = (ref64 - got64).abs()
        max_abs = diff.max().item() if diff.numel() else 0.0
        scale = ref64.abs().max().item() if ref64.numel() else 0.0
        max_rel = max_abs / scale if scale > 0 else max_abs  # relative to the output's magnitude
        row = {"output": name, "shape": list(ref.shape), "max_abs": max_abs, "max_rel": max_rel, "ref_max": scale}
        if atol is not None:
            row["tol"] = atol + rtol * scale
            row["ok"] = bool(max_abs <= row["tol"])
        rows.append(row)
    return rows


def run_both(original: Callable, rewritten: Callable, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    with torch.no_grad():
        return original(*args, **kwargs), rewritten(*args, **kwargs)
