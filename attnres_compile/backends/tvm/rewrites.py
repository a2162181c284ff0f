"""Module rewrites of the pipeline. Before legalization: powers to multiplications, `take` in a
mode that cannot read out of bounds, sigmoid to exp so that FastMath (which knows exp, tanh, erf
and softmax) makes it vectorisable, then FastMath.
Between FuseOps and FuseTIR: symbolic scalars moved into the fused function's shape argument.
After the default schedules: a root block for the functions that lack one."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, s_tir
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
    """A fused function taking a symbolic scalar (`shape_to_tensor(shape_of(mask))` of a dim nothing
    else binds) AND a `tir_vars` shape (an input-less op such as `arange(batch)` in the same group)
    takes the scalar inside the shape instead. TVM 0.27's FuseTIR fails on the pair ("Check failed:
    (VarRemapGet(source) == nullptr)" in RenewDefs; the dynamic-shape HF Llama's attention-mask
    indexing); as one shape argument the fused kernel, its parameters and its values are the same."""

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
