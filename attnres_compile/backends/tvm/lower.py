"""`LowerDepthAttention`: every placeholder site (sites.py) becomes one call_tir to a fused kernel.

Sources with the feature axis last go in as they are; others are permuted to [rows, D] and back.
Kernels (kernels/tensorir.py, schedule.py) are added once and marked scheduled and opaque, so
dlight, the tuner and FuseOps leave them whole. Sites sharing a history may become a chain of
partials plus one merge per site (docs/design.md §6). Each site has one site-kernel call (names
start with KERNEL_PREFIX, partials with PARTIAL_PREFIX).
"""

from __future__ import annotations

import functools
import operator
from collections import Counter
from dataclasses import dataclass

import tvm
from tvm import relax, tirx
from tvm.ir.transform import PassContext, module_pass
from tvm.relax import expr_functor
from tvm.target import Target

from ...core.errors import CompileError
from ...core.two_phase import site_groups, two_phase_wins
from ...kernels.cache import partial_links
from ...kernels.schedule import schedule_cpu, schedule_cuda
from ...kernels.tensorir import (
    DTYPES,
    depth_attention_func,
    depth_attention_merge_indexed_func,
    depth_attention_partial_func,
)
from . import site_norm as norm_fusion
from .sites import Site, parse

KERNEL_PREFIX = "attnres_depth_attention"
PARTIAL_PREFIX = f"{KERNEL_PREFIX}_partial"
OPAQUE = 8  # relax OpPatternKind::kOpaque


def kernel_name(num_sources: int, size: int, dtype: str, variant: int = 0) -> str:
    """The module-level name of a kernel; `variant` counts other (eps, scale) of the same shape."""
    return f"{KERNEL_PREFIX}_n{num_sources}_d{size}_{dtype}" + (f"_{variant}" if variant else "")


def _finish(func: tirx.PrimFunc, target: Target) -> tirx.PrimFunc:
    """Scheduled and marked. Module-private (no global_symbol), so that when a pass rewrites a kernel
    into a copy (AttachAttrLayoutFreeBuffers) dead-code elimination drops the original instead of
    compiling it twice."""
    schedule = schedule_cuda if target.kind.name == "cuda" else schedule_cpu
    return schedule(func, target).without_attr("global_symbol").with_attrs({"tirx.is_scheduled": True,
                                                                          "op_pattern": OPAQUE})


@dataclass
class _Group:
    """Sites lowered together: their shared history (original Relax exprs) and, once emitted, the
    partial chain's state (m, l, acc) and its kernels."""

    history: list[relax.Expr]
    queries: list[relax.Expr]
    links: list[int]  # where the partial chain's links start, then the history's length (partial_links)
    state: list[relax.Expr] | None = None
    kernels: list[str] | None = None


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
        self.groups: dict[relax.Call, tuple[_Group, int]] = {}  # placeholder -> (its group, its index there)
        self.norms = norm_fusion.Plan()  # the next norms the site kernels apply (CPU)

    def plan(self, func: relax.Function) -> None:
        """Group the placeholders of `func` that share a history where the two-phase form wins,
        and find the norms to fuse into their sites' kernels (norm_fusion)."""
        if self.target.kind.name == "llvm":  # the CUDA schedule has no fused-norm stages
            self.norms.add(func)
        found: list[relax.Call] = []
        relax.analysis.post_order_visit(func, lambda e: found.append(e) if isinstance(e, relax.Call) and parse(e) else None)
        chains: dict[tuple, list[tuple[relax.Call, Site]]] = {}
        for call in found:
            site = parse(call)
            if isinstance(call.ty, relax.TensorType) and str(call.ty.dtype) in DTYPES:
                chains.setdefault((site.sources[0], site.eps, site.axis, str(call.ty.dtype)), []).append((call, site))
        for (*_, dtype), members in chains.items():
            keys: dict[relax.Expr, int] = {}
            terms = [[keys.setdefault(s, len(keys)) for s in site.sources] for _, site in members]
            before: list[int] = []  # the previous group's history
            bounds = [0]
            for start, end, length in site_groups(terms):
                sites = [site for _, site in members[start:end]]
                extras = [len(site.sources) - length for site in sites]
                if end - start < 2 or not two_phase_wins(length, extras, tvm.DataType(dtype).bits // 8):
                    continue
                history = terms[start][:length]
                bounds = partial_links(bounds if history[:len(before)] == before else [0], length)
                before = history
                group = _Group(list(sites[0].sources[:length]), [site.query for site in sites], bounds)
                self.groups.update({call: (group, i) for i, (call, _) in enumerate(members[start:end])})

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var not in self.norms.dropped:  # a fused norm's intermediate: not emitted
            super().visit_var_binding_(binding)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        planned, norm = self.groups.get(call), self.norms.norms.get(call)
        if call in self.norms.replaced:
            return self.visit_expr(self.norms.replaced[call])  # the site's kernel applied the norm
        call = super().visit_call_(call)
        site = parse(call)
        return call if site is None else self.lower(site, call.ty, planned, norm)

    def lower(self, site: Site, ty: relax.TensorType, planned: tuple[_Group, int] | None,
              norm: norm_fusion.Norm | None = None) -> relax.Expr:
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
        # the row dims the kernel sees: the sources' own when the feature axis is last
        rows = [shape[d] for d in order[:-1]] if _native(order) else [_product([shape[d] for d in order[:-1]])]
        shared = len(planned[0].history) if planned else 0
        flat = [self.to_rows(s, order, rows, size) for s in site.sources[shared:]]
        query = self.float32(site.query)
        record = {"sources": len(site.sources), "feature_size": size, "dtype": dtype, "axis": site.axis,
                  "eps": site.eps, "scale": site.scale}
        fused, affine = (), []
        if norm is not None:
            fused = (norm.kind, norm.eps)
            # a gain computed at the norm (Gemma's 1 + weight) is computed here, before the kernel
            affine = [bb.emit(self.visit_expr(t)) if isinstance(t, relax.Call) else self.visit_expr(t)
                      for t in (norm.gamma, norm.beta) if t is not None]
            record[f"{norm.kind}_norm_eps"] = norm.eps
        delta = site.base is not None
        plus = []
        if delta:  # Delta AttnRes: the plain sum in the sources' layout, the gate as float32 [1]
            plus = [self.to_rows(site.base, order, rows, size),
                    self.builder_.emit(relax.op.reshape(self.float32(site.gate), relax.ShapeExpr([1])))]
            record["delta"] = True
        if planned:  # the query's index and the scale are the merge kernel's arguments
            group, index = planned
            if group.state is None:
                group.state = self.partial(group, order, rows, size, dtype, site.eps)
            kernel = self.kernel("merge", (len(group.queries), len(flat), size), dtype, (site.eps, *fused), len(rows) + 1,
                                 delta)
            args = [*group.state, *flat, query, *plus, *affine, relax.prim_value(index, "int64"),
                    relax.prim_value(site.scale, "float32")]
            record["partial"] = group.kernels
        else:
            kernel = self.kernel("site", (len(flat), size), dtype, (site.eps, site.scale, *fused), len(rows) + 1, delta)
            args = [*flat, query, *plus, *affine]
        self.lowered.append({"kernel": kernel.name_hint, **record})
        out = relax.call_tir(kernel, args, relax.TensorType([*rows, size], dtype))
        if len(rows) + 1 != ndim:
            out = relax.op.reshape(bb.emit(out), relax.ShapeExpr([shape[d] for d in order]))
        if order != list(range(ndim)):
            out = relax.op.permute_dims(bb.emit(out), [order.index(d) for d in range(ndim)])
        return out

    def partial(self, group: _Group, order: list[int], rows: list, size: int, dtype: str,
                eps: float) -> list[relax.Expr]:
        """The partial chain of `group`, emitted before its first site: (m, l, acc) for all its queries,
        shaped [B, *rows(, D)], one call per link (at most PARTIAL_CHUNK sources, sources as they are),
        each continuing the state before it."""
        bb = self.builder_
        history = [self.to_rows(self.visit_expr(h), order, rows, size) for h in group.history]
        queries = bb.emit(relax.op.stack([self.float32(self.visit_expr(q)) for q in group.queries], axis=0))
        B = len(group.queries)
        out = [relax.TensorType([B, *rows], "float32"), relax.TensorType([B, *rows], "float32"),
               relax.TensorType([B, *rows, size], "float32")]
        parts, group.kernels = [], []
        for start, end in zip(group.links, group.links[1:]):
            links = history[start:end]
            kernel = self.kernel("partial", (len(links), B, size, bool(parts)), dtype, (eps,), len(rows) + 1)
            group.kernels.append(kernel.name_hint)
            state = bb.emit(relax.call_tir(kernel, [*links, queries, *parts], out))
            parts = [bb.emit(relax.TupleGetItem(state, i)) for i in range(3)]
        return parts

    def float32(self, query: relax.Expr) -> relax.Expr:
        return query if query.ty.dtype == "float32" else self.builder_.emit(relax.op.astype(query, "float32"))

    def shape_of(self, site: Site, ty: relax.TensorType) -> list:
        """The sources' shape: the placeholder's type when known, else bound by a match_cast."""
        if isinstance(ty.shape, relax.ShapeExpr):
            return list(ty.shape.values)
        dims = [tirx.Var(f"attnres_d{i}", "int64") for i in range(ty.ndim)]
        self.builder_.match_cast(site.sources[0], relax.TensorType(dims, ty.dtype))
        return dims

    def to_rows(self, source: relax.Expr, order: list[int], rows: list, size: int) -> relax.Expr:
        """`source` as [*rows, size]: as it is when its feature axis is last, else that axis moved last
        (a copy) and the rest flattened (a view)."""
        if _native(order):
            return source
        if order != list(range(len(order))):
            source = self.builder_.emit(relax.op.permute_dims(source, order))
        if len(order) == 2:
            return source
        return self.builder_.emit(relax.op.reshape(source, relax.ShapeExpr([*rows, size])))

    def kernel(self, kind: str, shape: tuple, dtype: str, params: tuple, rank: int, delta: bool = False) -> relax.GlobalVar:
        """The `kind` kernel ("site", "merge", "partial") for `shape`, `dtype`, `params` (eps, a site's
        scale, a fused norm's kind and eps) and sources of rank `rank` (`delta`: Delta AttnRes' form,
        taking the plain sum and the gate after the query), generated, scheduled and added once."""
        key = (kind, shape, dtype, params, rank, delta)
        if key not in self.kernels:
            variant = sum(k[:3] == key[:3] and k[5] == delta for k in self.kernels)
            name, func = _make_kernel(kind, shape, dtype, params, variant, rank, delta)
            self.kernels[key] = self.builder_.add_func(_finish(func, self.target), name)
        return self.kernels[key]


def _native(order: list[int]) -> bool:
    """Whether sources with this axis order (feature axis last) go to the kernel as they are."""
    return len(order) >= 2 and order == list(range(len(order)))


def _make_kernel(kind: str, shape: list[int], dtype: str, params: tuple, variant: int,
                 rank: int = 2, delta: bool = False) -> tuple[str, tirx.PrimFunc]:
    """(name, unscheduled function) of a site, merge or partial kernel over rank-`rank` sources;
    `variant` tells apart kernels of one shape and dtype with another eps, scale or rank; `delta`:
    Delta AttnRes' site or merge (named ..._delta...)."""
    tail = f"_{dtype}" + (f"_{variant}" if variant else "")
    if kind in ("site", "merge"):  # params (eps[, scale][, norm kind, norm eps]): "_ln" / "_rms" kernels
        eps, *rest = params  # store the normed output
        scale, norm = (rest[0], rest[1:]) if kind == "site" else (None, rest)
        norm_kind, norm_eps = norm if norm else ("layer", None)
        suffix = ("_delta" if delta else "") + ({"layer": "_ln", "rms": "_rms"}[norm_kind] if norm else "")
    if kind == "site":
        sources, size = shape
        return (kernel_name(sources, size, dtype, variant) + suffix,
                depth_attention_func(sources, size, dtype, eps, scale, rank, norm_eps, norm_kind, delta))
    if kind == "merge":  # index and scale: arguments
        queries, extras, size = shape
        return (f"{KERNEL_PREFIX}_merge_q{queries}_e{extras}_d{size}{tail}{suffix}",
                depth_attention_merge_indexed_func(queries, extras, size, dtype, eps, rank, norm_eps, norm_kind, delta))
    (history, queries, size, start), (eps,) = shape, params  # start: the link continues a state
    return (f"{PARTIAL_PREFIX}_j{history}_q{queries}_d{size}{tail}" + ("_cont" if start else ""),
            depth_attention_partial_func(history, queries, size, dtype, eps, rank, start))


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
                lowerer.plan(func)
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
