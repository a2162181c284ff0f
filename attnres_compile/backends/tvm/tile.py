"""Tile (ONNX) and repeat (torch) by counts known only as symbolic dims (SigLIP's per-image probe),
which both stock TVM converters refuse; shared by both importers.
"""

from __future__ import annotations

import tvm
from tvm import relax


def tile(bb: relax.BlockBuilder, data: relax.Expr, reps: list) -> relax.Expr:
    """`data` repeated `reps[i]` times along axis i (ints or symbolic dims; the shorter of data's
    dims and reps padded with leading 1s, as ONNX Tile and torch's repeat do), as a reshape, a
    broadcast and a reshape, so the output dims stay the products `reps[i] * dim[i]`."""
    dims = list(data.ty.shape.values)
    rank = max(len(dims), len(reps))
    one = tvm.tirx.IntImm("int64", 1)
    dims = [one] * (rank - len(dims)) + dims
    reps = [one] * (rank - len(reps)) + [tvm.tirx.IntImm("int64", r) if isinstance(r, int) else r for r in reps]
    spread = bb.emit(relax.op.reshape(data, relax.ShapeExpr([d for dim in dims for d in (one, dim)])))
    copies = bb.emit(relax.op.broadcast_to(spread, relax.ShapeExpr([d for pair in zip(reps, dims) for d in pair])))
    return relax.op.reshape(copies, relax.ShapeExpr([r * d for r, d in zip(reps, dims)]))


def symbolic(reps: list) -> bool:
    """Whether some repeat count is a symbolic dim rather than an integer."""
    return any(not isinstance(r, (int, tvm.tirx.IntImm)) for r in reps)
