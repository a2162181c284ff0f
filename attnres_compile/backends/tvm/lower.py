"""`LowerDepthAttention`: every placeholder site (sites.py) becomes one call_tir to the fused kernel.

Per site: the sources are brought to [rows, D] (a reshape, which the build turns into a view;
for a feature axis other than the last, e.g. NCHW streams, first a permute_dims that moves it
last, a copy per source and site), the kernel for (arity, D, dtype, eps, scale) is generated
by kernel.py, scheduled by hand for the target (schedule.py) and added once to the module,
and the [rows, D] result is reshaped (and permuted) back. The kernels are marked
`tirx.is_scheduled` (dlight and the tuner leave them alone) and opaque (FuseOps keeps them
whole instead of merging them with their neighbours into an unscheduled function).
"""

from __future__ import annotations

import functools
import operator
from collections import Counter

import tvm
from tvm import relax, tirx
from tvm.ir.transform import PassContext, module_pass
from tvm.relax import expr_functor
from tvm.target import Target

from ...errors import CompileError
from .kernel import DTYPES, depth_attention_func
from .schedule import schedule_cpu, schedule_cuda
from .sites import Site, parse

KERNEL_PREFIX = "attnres_depth_attention"
OPAQUE = 8  # relax OpPatternKind::kOpaque


def kernel_name(num_sources: int, size: int, dtype: str, variant: int = 0) -> str:
    """The module-level name of a kernel; `variant` counts other (eps, scale) of the same shape."""
    return f"{KERNEL_PREFIX}_n{num_sources}_d{size}_{dtype}" + (f"_{variant}" if variant else "")


def scheduled_kernel(num_sources: int, size: int, dtype: str, eps: float, scale: float, target: Target,
                     name: str) -> tirx.PrimFunc:
    """The fused kernel, scheduled for `target`, named `name`, marked as scheduled and opaque."""
    func = depth_attention_func(num_sources, size, dtype, eps, scale)
    schedule = schedule_cuda if target.kind.name == "cuda" else schedule_cpu
    func = schedule(func, target)
    return func.with_attrs({"global_symbol": name, "tirx.is_scheduled": True, "op_pattern": OPAQUE})


def _product(dims: list) -> tirx.PrimExpr:
    """The number of rows: the product of the non-feature dims (1 for rank-1 sources)."""
    return functools.reduce(operator.mul, dims) if dims else tirx.IntImm("int64", 1)


@expr_functor.mutator
class _SiteLowerer(expr_functor.PyExprMutator):
    """Rewrites placeholder calls (after visiting their arguments); adds each kernel once."""

    def __init__(self, mod: tvm.IRModule, target: Target):
        super().__init__(mod)
        self.target = target
        self.kernels: dict[tuple, relax.GlobalVar] = {}
        self.lowered: list[dict] = []

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        site = parse(call)
        return call if site is None else self.lower(site, call.ty)

    def lower(self, site: Site, ty: relax.TensorType) -> relax.Expr:
        bb = self.builder_
        ndim, dtype = ty.ndim, str(ty.dtype)
        if dtype not in DTYPES:
            raise CompileError(f"depth-attention site over {dtype} sources: the fused kernel takes {', '.join(DTYPES)}")
        if ndim < 1:
            raise CompileError("depth-attention site whose sources have an unknown rank after import")
        axis = site.axis % ndim
        shape = self.shape_of(site, ty)
        size = shape[axis]
        if not isinstance(size, tirx.IntImm):
            raise CompileError(f"depth-attention site with a symbolic feature axis ({size}): the kernel needs a static size")
        size = int(size)
        order = [d for d in range(ndim) if d != axis] + [axis]
        rows = _product([shape[d] for d in order[:-1]])
        flat = [self.to_rows(s, order, rows, size) for s in site.sources]
        query = site.query if site.query.ty.dtype == "float32" else bb.emit(relax.op.astype(site.query, "float32"))
        kernel = self.kernel(len(flat), size, dtype, site.eps, site.scale)
        self.lowered.append({"kernel": kernel.name_hint, "sources": len(flat), "feature_size": size, "dtype": dtype,
                             "axis": site.axis, "eps": site.eps, "scale": site.scale})
        out = relax.call_tir(kernel, [*flat, query], relax.TensorType([rows, size], dtype))
        if ndim != 2:
            out = relax.op.reshape(bb.emit(out), relax.ShapeExpr([shape[d] for d in order]))
        if order != list(range(ndim)):
            out = relax.op.permute_dims(bb.emit(out), [order.index(d) for d in range(ndim)])
        return out

    def shape_of(self, site: Site, ty: relax.TensorType) -> list:
        """The sources' shape: the placeholder's type when known, else bound by a match_cast."""
        if isinstance(ty.shape, relax.ShapeExpr):
            return list(ty.shape.values)
        dims = [tirx.Var(f"attnres_d{i}", "int64") for i in range(ty.ndim)]
        self.builder_.match_cast(site.sources[0], relax.TensorType(dims, ty.dtype))
        return dims

    def to_rows(self, source: relax.Expr, order: list[int], rows: tirx.PrimExpr, size: int) -> relax.Expr:
        """`source` as [rows, size]: feature axis moved last (a copy) if it is not, then a reshape (a view)."""
        if order != list(range(len(order))):
            source = self.builder_.emit(relax.op.permute_dims(source, order))
        if len(order) == 2:
            return source
        return self.builder_.emit(relax.op.reshape(source, relax.ShapeExpr([rows, size])))

    def kernel(self, num_sources: int, size: int, dtype: str, eps: float, scale: float) -> relax.GlobalVar:
        key = (num_sources, size, dtype, eps, scale)
        if key not in self.kernels:
            variant = sum(k[:3] == key[:3] for k in self.kernels)
            name = kernel_name(num_sources, size, dtype, variant)
            func = scheduled_kernel(num_sources, size, dtype, eps, scale, self.target, name)
            self.kernels[key] = self.builder_.add_func(func, name)
        return self.kernels[key]


@module_pass(opt_level=0, name="LowerDepthAttention")
class LowerDepthAttention:
    """Replace every depth-attention placeholder of the module's Relax functions by the fused kernel."""

    def __init__(self, target: Target | dict | str):
        self.target = Target(target)
        self.lowered: list[dict] = []  # per site, in program order, after a run: kernel, sources, feature_size, ...

    def transform_module(self, mod: tvm.IRModule, ctx: PassContext) -> tvm.IRModule:
        lowerer = _SiteLowerer(mod, self.target)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                lowerer.builder_.update_func(gv, lowerer.visit_expr(func))
        self.lowered = lowerer.lowered
        return lowerer.builder_.finalize()


def calls(mod: tvm.IRModule, func: str = "main") -> Counter:
    """What the Relax function `func` calls, counted: op names ("relax.nn.softmax"), call_tir
    callees by name, and packed functions as "packed:<name>" (placeholders: packed:attnres.depth_attention)."""
    counts: Counter = Counter()

    def visit(expr) -> None:
        if not isinstance(expr, relax.Call):
            return
        op = expr.op
        if isinstance(op, tvm.ir.Op) and op.name in ("relax.call_tir", "relax.call_pure_packed") and expr.args:
            callee = expr.args[0]
            counts[callee.name_hint if isinstance(callee, relax.GlobalVar) else f"packed:{callee.global_symbol}"] += 1
        elif isinstance(op, tvm.ir.Op):
            counts[op.name] += 1
        elif isinstance(op, relax.GlobalVar):
            counts[op.name_hint] += 1

    relax.analysis.post_order_visit(mod[func], visit)
    return counts
