"""The Relax placeholder for one depth-attention site, shared by both importers and the lowering.

    R.call_pure_packed("attnres.depth_attention", s_1, ..., s_n, query, eps, scale, axis)

eps and scale float64 and axis int64 prim values, typed like the sources. No packed function of
that name exists, so a module that skipped `LowerDepthAttention` fails to build instead of
running something else. Delta sites are `"attnres.depth_attention_delta"` with `base` (typed
like the sources) and a scalar `gate` after the query.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax

PACKED_NAME = "attnres.depth_attention"
DELTA_PACKED_NAME = "attnres.depth_attention_delta"


@dataclass(frozen=True)
class Site:
    """The operands of one placeholder call."""

    sources: tuple[relax.Expr, ...]
    query: relax.Expr
    eps: float
    scale: float
    axis: int
    base: relax.Expr | None = None  # Delta AttnRes: the plain sum and the gate
    gate: relax.Expr | None = None


def delta_call(sources: list[relax.Expr], query: relax.Expr, base: relax.Expr, gate: relax.Expr, eps: float,
               scale: float, axis: int) -> relax.Call:
    """The placeholder for Delta AttnRes: `base` + `gate` * the site over `sources`, typed like `base`."""
    return relax.op.call_pure_packed(
        DELTA_PACKED_NAME, *sources, query, base, gate,
        relax.prim_value(float(eps), "float64"), relax.prim_value(float(scale), "float64"),
        relax.prim_value(int(axis), "int64"),
        ty_args=_best_type([base, *sources]),
    )


def site_call(sources: list[relax.Expr], query: relax.Expr, eps: float, scale: float, axis: int) -> relax.Call:
    """The placeholder for AttnRes over `sources` (same shape and dtype) with pseudo-query `query`,
    typed like the first source whose shape is fully known (an importer may lose one's shape).
    """
    return relax.op.call_pure_packed(
        PACKED_NAME, *sources, query,
        relax.prim_value(float(eps), "float64"), relax.prim_value(float(scale), "float64"),
        relax.prim_value(int(axis), "int64"),
        ty_args=_best_type(sources),
    )


def _best_type(sources: list[relax.Expr]) -> relax.TensorType:
    for s in sources:
        if isinstance(s.ty, relax.TensorType) and isinstance(s.ty.shape, relax.ShapeExpr):
            return s.ty
    return sources[0].ty


def parse(call: relax.Call) -> Site | None:
    """The site a placeholder call carries, or None for any other call."""
    if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.call_pure_packed"):
        return None
    callee, *args = call.args
    if not (isinstance(callee, relax.ExternFunc) and callee.global_symbol in (PACKED_NAME, DELTA_PACKED_NAME)):
        return None
    *tensors, eps, scale, axis = args
    if callee.global_symbol == DELTA_PACKED_NAME:
        *sources, query, base, gate = tensors
        return Site(tuple(sources), query, float(eps.value), float(scale.value), int(axis.value), base, gate)
    *sources, query = tensors
    return Site(tuple(sources), query, float(eps.value), float(scale.value), int(axis.value))
