"""The Relax placeholder for one depth-attention site, shared by both importers and the lowering.

The ONNX and PyTorch importers (importers.py) turn each site into

    R.call_pure_packed("attnres.depth_attention", s_1, ..., s_n, query, eps, scale, axis)

with eps and scale float64 and axis int64 prim values, typed like the sources. No packed
function of that name exists: the placeholder only carries the site through import, and
`LowerDepthAttention` (lower.py) must replace every one by a call to the fused kernel, so a
module that skipped the lowering fails to build instead of running something else.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax

PACKED_NAME = "attnres.depth_attention"


@dataclass(frozen=True)
class Site:
    """The operands of one placeholder call."""

    sources: tuple[relax.Expr, ...]
    query: relax.Expr
    eps: float
    scale: float
    axis: int


def site_call(sources: list[relax.Expr], query: relax.Expr, eps: float, scale: float, axis: int) -> relax.Call:
    """The placeholder for AttnRes over `sources` (same shape and dtype) with pseudo-query `query`.

    Typed like the first source whose shape is fully known: importers can lose a source's
    shape (a broadcast add of symbolic dims) while another source keeps it.
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
    if not (isinstance(callee, relax.ExternFunc) and callee.global_symbol == PACKED_NAME):
        return None
    *tensors, eps, scale, axis = args
    *sources, query = tensors
    return Site(tuple(sources), query, float(eps.value), float(scale.value), int(axis.value))
