"""`relax.cumsum` as a scan kernel that holds for symbolic shapes (module pass `LegalizeCumsum`).
TOPI's scan, which DispatchSortScan picks, uses the caller's shape variables without binding them
and fails to build with a symbolic dim ("variables ... are used, but are not passed in as API
arguments"). Before that dispatch the input is viewed as [outer, length, inner] and one opaque
block scans each line. CPU only: TVM's GPU scan builds with symbolic dims."""

from __future__ import annotations

import functools

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.script import tirx as T

from .rewrites import is_op, rewrite_functions


@tvm.transform.module_pass(opt_level=0, name="LegalizeCumsum")
class LegalizeCumsum:
    """Every `relax.cumsum` call -> reshape, `call_tir` of the scan kernel, reshape."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_functions(mod, _CumsumMutator)


@mutator
class _CumsumMutator(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not is_op(call, "relax.cumsum"):
            return call
        ty = call.args[0].ty
        if isinstance(ty, relax.TensorType) and ty.shape is not None and ty.ndim >= 1:
            return _legalize(self.builder_, call)
        return call


def _legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """`cumsum(x, axis, dtype, exclusive)` as reshape, the scan kernel, reshape."""
    x = call.args[0]
    shape = list(x.ty.shape)
    out_dtype = str(call.attrs.dtype) if call.attrs.dtype is not None and str(call.attrs.dtype) else x.ty.dtype
    if call.attrs.axis is None:  # over the flattened input, as numpy: a 1-D result
        shape = [_product(shape)]
        axis = 0
    else:
        axis = int(call.attrs.axis) % len(shape)
    lines = (_product(shape[:axis]), shape[axis], _product(shape[axis + 1:]))
    scan = bb.add_func(_scan(x.ty.dtype, out_dtype, bool(call.attrs.exclusive)), "cumsum")
    flat = bb.emit(relax.op.reshape(x, lines))
    out = bb.emit(relax.call_tir(scan, [flat], relax.TensorType(lines, out_dtype)))
    return relax.op.reshape(out, shape)


def _product(dims: list) -> tvm.tirx.PrimExpr:
    return functools.reduce(lambda a, b: a * b, dims, tvm.tirx.IntImm("int64", 1))


@functools.lru_cache(maxsize=None)
def _scan(in_dtype: str, out_dtype: str, exclusive: bool) -> tvm.tirx.PrimFunc:
    """out[i, j, k] = sum of x[i, j', k] over j' <= j (j' < j when exclusive), in out_dtype."""
    zero = tvm.tirx.const(0, out_dtype)
    shift = 0 if exclusive else 1

    @T.prim_func(private=True, s_tir=True)
    def scan(a: T.handle, b: T.handle):
        T.func_attr({"tirx.noalias": True})
        n, length, m = T.int64(), T.int64(), T.int64()
        x = T.match_buffer(a, (n, length, m), in_dtype)
        out = T.match_buffer(b, (n, length, m), out_dtype)
        with T.sblock("cumsum"):  # opaque: each step reads the one before it
            for i, k in T.grid(n, m):
                if length > T.int64(0):
                    out[i, T.int64(0), k] = zero if exclusive else T.Cast(out_dtype, x[i, T.int64(0), k])
                    for j in range(length - T.int64(1)):  # exclusive: step j + 1 adds x[j], else x[j + 1]
                        out[i, j + T.int64(1), k] = out[i, j, k] + T.Cast(out_dtype, x[i, j + T.int64(shift), k])

    return scan
