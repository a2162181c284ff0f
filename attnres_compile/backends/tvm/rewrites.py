"""Module rewrites of the pipeline. Before legalization: powers to products, out-of-bounds-safe
`take`, sigmoid via exp then FastMath, attention scores against the keys as stored
(`KeysInPlace`). Between FuseOps and FuseTIR: symbolic scalars into the shape argument. After the
default schedules: a root block for functions that lack one."""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, s_tir, sym, te, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.relax.transform.fast_math import FastMathCodeGenerator

MAX_POWER = 4  # x**n for integer 1 <= n <= MAX_POWER becomes n - 1 multiplications at most


def is_op(call: relax.Call, name: str) -> bool:
    return isinstance(call.op, tvm.ir.Op) and call.op.name == name


@mutator
class _PowerMutator(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not is_op(call, "relax.power"):
            return call
        base, exponent = call.args
        n = _small_integer(exponent)
        if n is None or not isinstance(base.ty, relax.TensorType) or base.ty.dtype != call.ty.dtype:
            return call
        square = self.builder_.emit(relax.op.multiply(base, base)) if n >= 2 else base
        return {1: base, 2: square, 3: relax.op.multiply(square, base), 4: relax.op.multiply(square, square)}[n]


def _small_integer(expr: relax.Expr) -> int | None:
    """n when `expr` is a scalar constant equal to an integer 1 <= n <= MAX_POWER, else None."""
    if not isinstance(expr, tvm.ir.GenericConst):
        return None
    value = expr.value.numpy()
    if value.size != 1 or value.ndim > 0:  # a scalar: the result has the base's shape
        return None
    x = float(value.reshape(()))
    return int(x) if x == int(x) and 1 <= x <= MAX_POWER and np.isfinite(x) else None


@mutator
class _SigmoidMutator(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not is_op(call, "relax.sigmoid") or not str(call.ty.dtype).startswith("float"):
            return call
        one = relax.const(1.0, str(call.ty.dtype))
        denominator = self.builder_.emit(relax.op.add(one, relax.op.exp(relax.op.negative(call.args[0]))))
        return relax.op.divide(one, denominator)


def rewrite_functions(mod: tvm.IRModule, make) -> tvm.IRModule:
    """`mod` with each Relax function passed through the mutator `make(mod)` builds."""
    rewriter = make(mod)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
    return rewriter.builder_.get()


@tvm.transform.module_pass(opt_level=0, name="RewritePowers")
class RewritePowers:
    """`pow(x, n)` for a constant integer n in 1..4 -> multiplications: TVM lowers pow to scalar
    powf calls (and warns "pow(x, y) where y >= 3"); GELU-tanh's x**3 and RMSNorm's x**2 become
    vectorised multiplies. x*x*x differs from powf(x, 3) by at most two roundings."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_functions(mod, _PowerMutator)


@tvm.transform.module_pass(opt_level=0, name="ExpandSigmoid")
class ExpandSigmoid:
    """`sigmoid(x)` -> `1 / (1 + exp(-x))` (CPU, before FastMathTransform): TVM lowers sigmoid to a
    scalar expf call per element, which made SiLU the slowest part of a Llama MLP's epilogue.
    Large |x| saturate to 0 and 1 as sigmoid does."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_functions(mod, _SigmoidMutator)


@mutator
class _TakeMutator(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not is_op(call, "relax.take") or call.attrs.mode != "fast":
            return call
        return relax.op.take(call.args[0], call.args[1], call.attrs.axis, mode="wrap")


@tvm.transform.module_pass(opt_level=0, name="WrapTakeIndices")
class WrapTakeIndices:
    """`take` (embedding lookups, Gather) in mode "wrap" instead of the frontends' "fast": fast
    reads out of bounds on an index past the table (a token id beyond the vocabulary), where the
    process may crash, and TVM warns at every such take when it builds. Wrap reads index mod
    size: the same element for every index torch and ONNX accept, negative ones included."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_functions(mod, _TakeMutator)


@mutator
class _FastMathMutator(FastMathCodeGenerator._cls):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        if isinstance(call.op, tvm.ir.Op):
            return super().visit_call_(call)
        return PyExprMutator.visit_call_(self, call)


@tvm.transform.module_pass(opt_level=0, name="FastMath")
class FastMath:
    """TVM's FastMathTransform (exp, tanh, erf and softmax to their vectorisable approximations),
    minus its crash on calls of anything but an operator: it reads `call.op.name`, which a call of
    a packed function (`R.call_packed` of a runtime-shaped Expand) or of a Relax function lacks."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_functions(mod, _FastMathMutator)


@mutator
class _KeysMutator(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not is_op(call, "relax.matmul") or call.attrs.out_dtype not in (None, "", call.ty.dtype):
            return call
        a, b = call.args
        if not isinstance(a.ty, relax.TensorType) or a.ty.shape is None:
            return call
        found = self._swapped(b)
        if found is None:
            values = self._repeated(b)
            if values is None or a.ty.dtype != values[0].ty.dtype:
                return call
            grouped = self._grouped(a, *values, relax.op.matmul, call)
            return call if grouped is None else grouped
        keys, scale = found
        if a.ty.dtype != keys.ty.dtype or _many_rows(a):
            return call
        dims, key_dims = a.ty.shape.values, keys.ty.shape.values
        if not (_same_dims(dims[:-2], key_dims[:-2]) and _same_dims(dims[-1:], key_dims[-1:])):
            return call

        def scores(rows: relax.Expr, heads: relax.Expr) -> relax.Expr:
            return self.builder_.call_te(_scores, rows, heads, scale, primfunc_name_hint="matmul_keys")
        repeated = self._repeated(keys)
        grouped = None if repeated is None else self._grouped(a, *repeated, scores, call)
        return scores(a, keys) if grouped is None else grouped

    def _grouped(self, a: relax.Expr, heads: relax.Expr, repeat: int, product, call: relax.Call) -> relax.Expr | None:
        """`product(a, repeat_kv(heads))` as `product(a', heads)`: a, [.., heads * repeat, s, k], viewed as
        [.., heads, repeat * s, k] (the queries of one KV head are consecutive), the result viewed back;
        None where a's leading dims are not heads' (a broadcast)."""
        dims, kv = a.ty.shape.values, heads.ty.shape.values
        if len(dims) < 3 or not _same_dims(dims[:-3], kv[:-3]) or not _same_dims([dims[-3]], [kv[-3] * repeat]):
            return None
        rows = self.builder_.emit(relax.op.reshape(a, [*dims[:-3], kv[-3], repeat * dims[-2], dims[-1]]))
        out = self.builder_.emit(product(rows, heads))
        return relax.op.reshape(out, call.ty.shape)

    def _repeated(self, expr: relax.Expr) -> tuple[relax.Expr, int] | None:
        """(X, r) where `expr` is X, [.., heads, n, d], with every head repeated r times in a row (HF's
        repeat_kv for grouped-query attention: expand_dims before the rows, broadcast_to, reshape to
        [.., heads * r, n, d]), else None."""
        node = self._value(expr)
        if not (isinstance(node, relax.Call) and is_op(node, "relax.reshape")):
            return None
        wide = self._value(node.args[0])
        if not (isinstance(wide, relax.Call) and is_op(wide, "relax.broadcast_to")):
            return None
        narrow = self._value(wide.args[0])
        if not (isinstance(narrow, relax.Call) and is_op(narrow, "relax.expand_dims")):
            return None
        source = narrow.args[0]
        if not isinstance(getattr(source, "ty", None), relax.TensorType) or source.ty.shape is None:
            return None
        x, big = source.ty.shape.values, wide.ty.shape.values
        rank = len(x)
        axes = [int(v) % (rank + 1) for v in narrow.attrs.axis]
        if rank < 3 or axes != [rank - 2] or not isinstance(big[rank - 2], tvm.tirx.IntImm):
            return None
        repeat = int(big[rank - 2])
        if not (_same_dims(big, [*x[:-2], repeat, *x[-2:]])
                and _same_dims(node.ty.shape.values, [*x[:-3], x[-3] * repeat, *x[-2:]])):
            return None
        return source, repeat

    def _value(self, expr: relax.Expr) -> relax.Expr:
        bound = self.lookup_binding(expr) if isinstance(expr, relax.Var) else None
        return bound if bound is not None else expr

    def _swapped(self, b: relax.Expr) -> tuple[relax.Expr, float | None] | None:
        """(X, c) where `b` is X with its last two axes swapped, times the scalar constant c (None:
        no factor), through reshapes that keep the last two axes, X the deepest such tensor with
        b's leading dims; None where there is none."""
        scale, node = None, self._value(b)
        if isinstance(node, relax.Call) and is_op(node, "relax.multiply"):
            for x, c in (node.args, node.args[::-1]):
                value = _scalar(c)
                if value is not None and isinstance(x.ty, relax.TensorType) and _same_dims(x.ty.shape.values,
                                                                                           b.ty.shape.values):
                    scale, node = value, self._value(x)
                    break
            else:
                return None
        swaps, expr, keys = 0, node, None
        while isinstance(expr, relax.Call) and (is_op(expr, "relax.reshape") or is_op(expr, "relax.permute_dims")):
            source = expr.args[0]
            if not isinstance(getattr(source, "ty", None), relax.TensorType) or source.ty.shape is None:
                break
            inner, outer = source.ty.shape.values, expr.ty.shape.values
            if is_op(expr, "relax.permute_dims"):
                rank = len(inner)
                axes = [int(x) for x in expr.attrs.axes] if expr.attrs.axes is not None else None
                if swaps or rank < 3 or axes != [*range(rank - 2), rank - 1, rank - 2]:
                    break
                swaps += 1
            elif len(inner) < 3 or len(outer) < 3 or not _same_dims(inner[-2:], outer[-2:]):
                break
            node, expr = source, self._value(source)
            if swaps and _same_dims(node.ty.shape.values[:-2], b.ty.shape.values[:-2]):
                keys = node  # the deepest view with b's leading dims (grouped-query heads: after their repeat)
        return None if keys is None else (keys, scale)


PREFILL_ROWS = 16  # KeysInPlace: static query rows from which the scores stay a GEMM over a copy of K


def _many_rows(a: relax.Expr) -> bool:
    """Whether the queries `a` [.., rows, d] have a static number of rows of at least PREFILL_ROWS."""
    rows = a.ty.shape.values[-2]
    return isinstance(rows, tvm.tirx.IntImm) and int(rows) >= PREFILL_ROWS


def _same_dims(x, y) -> bool:
    analyzer = sym.Analyzer()
    return len(x) == len(y) and all(tvm_ffi.structural_equal(p, q) or analyzer.can_prove_equal(p, q)
                                    for p, q in zip(x, y))


def _scalar(expr: relax.Expr) -> float | None:
    """The value of a float32 scalar constant, else None."""
    if not isinstance(expr, tvm.ir.GenericConst) or str(expr.value.dtype) != "float32" or expr.value.numpy().size != 1:
        return None
    return float(expr.value.numpy().reshape(()))


def _scores(a: te.Tensor, keys: te.Tensor, scale: float | None) -> te.Tensor:
    """out[..., i, j] = sum_k a[..., i, k] * (keys[..., j, k] * scale): the matmul of `a` with the
    (scaled) transposed keys, each term as the transposed copy made it."""
    k = te.reduce_axis((0, a.shape[-1]), "k")

    def term(*index):
        *lead, i, j = index
        key = keys[(*lead, j, k)]
        if scale is not None:
            key = key * tirx.const(scale, keys.dtype)
        return te.sum(a[(*lead, i, k)] * key, axis=k)
    return te.compute((*a.shape[:-1], keys.shape[-2]), term, name="matmul")


@tvm.transform.module_pass(opt_level=0, name="KeysInPlace")
class KeysInPlace:
    """`matmul(q, reshape/permute(K) * c)` with the permute swapping K's last two axes -> one operator reading K where it is.

    ONNX's scaled dot-product attention, for which TVM would copy the keys three times per call.
    Grouped-query attention (HF's repeat_kv) also reads the cache unrepeated (`_grouped`). Scores of
    PREFILL_ROWS static queries or more keep the copy: there the product is a GEMM, and the copy one
    pass over K."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_functions(mod, _KeysMutator)


def _scalars_beside_tir_vars(func) -> list[int]:
    """Positions of the integer scalar parameters of a fused (Primitive) function whose last
    parameter is a shape (FuseOps' `tir_vars`); empty when it has no such pair."""
    if not (isinstance(func, relax.Function) and func.attrs and "Primitive" in func.attrs and func.params
            and isinstance(func.params[-1].ty, relax.ShapeType)):
        return []
    return [i for i, p in enumerate(func.params[:-1])
            if isinstance(p.ty, tvm.ir.PrimType) and str(p.ty.dtype).startswith("int")]


@mutator
class _ScalarArgsMutator(PyExprMutator):
    """Calls of the rewritten fused functions: the moved scalar arguments appended to the shape argument."""

    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.moved: dict[tvm.ir.GlobalVar, tuple[list[int], tvm.ir.GlobalVar]] = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.GlobalVar) and call.op in self.moved):
            return call
        indices, target = self.moved[call.op]
        *args, shape = call.args
        return relax.Call(target, [*(a for i, a in enumerate(args) if i not in indices),
                                   relax.ShapeExpr([*shape.values, *(args[i] for i in indices)])])


@tvm.transform.module_pass(opt_level=0, name="ScalarsIntoTirVars")
class ScalarsIntoTirVars:
    """A fused function taking both a symbolic scalar and a `tir_vars` shape takes the scalar inside the
    shape instead: FuseTIR fails on the pair ("VarRemapGet(source) == nullptr"), and the kernel is
    the same either way."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        changed = {gv: i for gv, func in mod.functions_items() if (i := _scalars_beside_tir_vars(func))}
        if not changed:
            return mod
        rewriter = _ScalarArgsMutator(tvm.IRModule({gv: f for gv, f in mod.functions_items() if gv not in changed}))
        for gv, indices in changed.items():  # new GlobalVars: a GlobalVar keeps its function's old signature
            func = mod[gv]
            *params, shape = func.params
            shape = relax.Var(shape.name, relax.ShapeType([*shape.ty.values, *(params[i] for i in indices)]))
            func = relax.Function([*(p for i, p in enumerate(params) if i not in indices), shape],
                                  func.body, func.ret_ty, func.is_pure, func.attrs)
            rewriter.moved[gv] = (indices, rewriter.builder_.add_func(func, gv.name_hint))
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function) and gv not in changed:
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return rewriter.builder_.get()


@tvm.transform.module_pass(opt_level=0, name="RootBlocks")
class RootBlocks:
    """A function whose body is a single block other than "root" (TOPI's hand-written cumsum) gets
    a root block around it, as every other function has: SplitLayoutRewritePreproc, which reads
    every function, stops on one without ("There should be a compute block if there is only one
    subtree under the root")."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        updates = {gv: func.with_body(_rooted(func.body)) for gv, func in mod.functions_items()
                   if isinstance(func, tvm.tirx.PrimFunc) and isinstance(func.body, s_tir.SBlockRealize)
                   and func.body.block.name_hint != "root"}
        if not updates:
            return mod
        return tvm.IRModule({gv: updates.get(gv, func) for gv, func in mod.functions_items()}, attrs=mod.attrs,
                            global_infos=mod.global_infos)


def _rooted(body: s_tir.SBlockRealize) -> s_tir.SBlockRealize:
    return s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", body))
