"""The next norm, fused into a site's kernel, which stores the normed row from the row still in cache.

Two patterns over the last axis of a float32 site value that nothing else reads (or of a
feature-preserving reshape of it, HF OPT): `relax.nn.layer_norm` and RMSNorm as exporters write
it, `gamma * (x * r)` with r = rsqrt(mean(x^2) + eps) or 1 / sqrt(...), every intermediate read
once. `Plan.add` finds them; the lowering gives the site an `_ln` / `_rms` kernel and replaces
the norm's last binding by the site's value.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from .sites import parse


@dataclass(frozen=True)
class Norm:
    """A norm a site's kernel applies: kind "layer" (gamma, beta) or "rms" (gamma; beta None).
    gamma and beta are values that exist at the site, or the operator call that computes one."""

    kind: str
    eps: float
    gamma: relax.Expr
    beta: relax.Expr | None = None


@dataclass
class Plan:
    """norms: site call -> its fused norm; replaced: the norm's last call -> the site's var (its
    value now); dropped: the vars of the norm's intermediate bindings, no longer emitted."""

    norms: dict = field(default_factory=dict)
    replaced: dict = field(default_factory=dict)
    dropped: set = field(default_factory=set)

    def add(self, func: relax.Function) -> None:
        """The sites of `func` whose value only a norm over the features reads, and that norm."""
        if not isinstance(func.body, relax.SeqExpr):
            return
        b = _Bindings(func)
        for var, value in b.value.items():
            site = parse(value) if isinstance(value, relax.Call) and _f32_tensor(value.ty) else None
            if site is None or site.axis % value.ty.ndim != value.ty.ndim - 1:
                continue
            view = _row_view(b, var)
            x = var if view is None else view
            match = _layer_norm(b, x, var) or _rms_norm(b, x, var)
            if match is not None:
                norm, last, steps = match
                self.norms[value] = norm
                self.replaced[b.value[last]] = x
                self.dropped.update(steps)


def emit_norm(bb: relax.BlockBuilder, x: relax.Var, params: list, eps: float, kind: str) -> relax.Var:
    """The norm of x (float32, a site's value) over its last axis, bound in `bb` in the forms `Plan.add`
    fuses into the site's kernel: relax.nn.layer_norm, or RMSNorm as torch.export writes it
    (x * rsqrt(mean(x^2) + eps), times the weight). `params`: [weight[, bias]] as given (the fused pair
    of ops/site_norm.py, an attnres.DepthAttentionNorm node); a missing weight is ones, a missing bias zeros."""
    size = int(x.ty.shape.values[-1])
    gamma = params[0] if params else relax.const(np.ones(size, "float32"))
    if kind == "layer":
        beta = params[1] if len(params) > 1 else relax.const(np.zeros(size, "float32"))
        return bb.emit(relax.op.nn.layer_norm(x, gamma, beta, axes=[-1], epsilon=eps))
    square = bb.emit(relax.op.power(x, relax.const(2.0, "float32")))
    mean = bb.emit(relax.op.mean(square, axis=[-1], keepdims=True))
    rinv = bb.emit(relax.op.rsqrt(bb.emit(relax.op.add(mean, relax.const(eps, "float32")))))
    return bb.emit(relax.op.multiply(bb.emit(relax.op.multiply(x, rinv)), gamma))


def _op(expr, *names: str) -> bool:
    """Whether expr calls an operator (one of `names`, if given)."""
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and (not names or expr.op.name in names)


def _f32_tensor(ty, ndim: int | None = None) -> bool:
    return (isinstance(ty, relax.TensorType) and str(ty.dtype) == "float32" and ty.ndim >= 1
            and (ndim is None or ty.ndim == ndim))


def _row_view(b: _Bindings, site: relax.Var) -> relax.Var | None:
    """The reshape that alone reads the site's value, if it keeps the feature size (HF OPT views its
    stream as [batch * seq, D] around the MLP): row-major, it maps rows to rows, so the norm of its
    rows is the reshaped norm of the site's rows."""
    view = b.only_reader(site, "relax.reshape")
    if view is None or not _f32_tensor(view.ty):
        return None
    shapes = [v.ty.shape for v in (site, view)]
    if not all(isinstance(s, relax.ShapeExpr) for s in shapes):
        return None
    sizes = [s.values[-1] for s in shapes]
    same = all(isinstance(n, tvm.tirx.IntImm) for n in sizes) and int(sizes[0]) == int(sizes[1])
    return view if same else None


def _affine(param: relax.Expr, x: relax.Var, b: _Bindings, site: relax.Var) -> relax.Expr | None:
    """A float32 [D] gamma or beta for x's features as the kernel call can take it: the value where it
    exists at the site, or the one-operator call that computes it later from such values (Gemma's
    `1 + weight`), which the lowering emits before the kernel. None otherwise."""
    if not _f32_tensor(param.ty, 1):
        return None
    value = param if b.before(param, site) else b.value.get(param)
    if not (value is param or _op(value) and all(_at_site(a, b, site) for a in value.args)):
        return None
    shapes = [t.ty.shape for t in (param, x)]
    if not all(isinstance(s, relax.ShapeExpr) for s in shapes):
        return value
    size, features = shapes[0].values[0], shapes[1].values[-1]
    fits = not (isinstance(size, tvm.tirx.IntImm) and isinstance(features, tvm.tirx.IntImm)) or int(size) == int(features)
    return value if fits else None


def _at_site(arg: relax.Expr, b: _Bindings, site: relax.Var) -> bool:
    """Whether a call argument exists where the site's kernel is called."""
    return isinstance(arg, tvm.ir.GenericConst) or isinstance(arg, relax.Var) and b.before(arg, site)


def _scalar(expr) -> float | None:
    """The value of a one-element float constant, else None."""
    if isinstance(expr, tvm.ir.GenericConst):
        array = expr.value.numpy()
        if array.size == 1 and array.dtype.kind == "f":
            return float(array.item())
    return None


def _last_axis(call: relax.Call, ndim: int) -> bool:
    axes = call.attrs.axes if _op(call, "relax.nn.layer_norm") else call.attrs.axis
    return axes is not None and [int(a) for a in axes] in ([-1], [ndim - 1])


class _Bindings:
    """The bindings of a function: value per var, and which bindings read each var."""

    def __init__(self, func: relax.Function):
        self.value: dict[relax.Var, relax.Expr] = {}
        self.readers: dict[relax.Var, list[relax.Var]] = {}
        self.uses: Counter = Counter()  # references anywhere
        self.args: Counter = Counter()  # references as a call's argument
        relax.analysis.post_order_visit(func.body, lambda e: self.uses.update([e]) if isinstance(e, relax.Var) else None)
        self.order: dict[relax.Var, int] = {}  # binding position
        for block in func.body.blocks:
            for binding in block.bindings:
                value = getattr(binding, "value", None)
                self.order[binding.var] = len(self.order)
                self.value[binding.var] = value
                if isinstance(value, relax.Call):
                    for arg in value.args:
                        if isinstance(arg, relax.Var):
                            self.args[arg] += 1
                            if not any(v.same_as(binding.var) for v in self.readers.get(arg, [])):
                                self.readers.setdefault(arg, []).append(binding.var)

    def before(self, expr: relax.Expr, var: relax.Var) -> bool:
        """Whether `expr` is defined where `var` is bound: not a var bound at or after it."""
        if not isinstance(expr, relax.Var) or expr not in self.order:
            return True
        return self.order[expr] < self.order[var]

    def read_by(self, var: relax.Var) -> list[relax.Var]:
        """The bindings whose calls read `var`, when nothing else does (a tuple, the output)."""
        return self.readers.get(var, []) if self.uses[var] == self.args[var] else []

    def only_reader(self, var: relax.Var, *ops: str) -> relax.Var | None:
        """The single binding reading `var` (read nowhere else), if its value is one of `ops`."""
        readers = self.read_by(var)
        if len(readers) == 1 and _op(self.value[readers[0]], *ops):
            return readers[0]
        return None


def _layer_norm(b: _Bindings, x: relax.Var, site: relax.Var) -> tuple[Norm, relax.Var, list] | None:
    """A LayerNorm over the last axis of x (the site's value or its row view) read only by it."""
    ln = b.only_reader(x, "relax.nn.layer_norm")
    if ln is None:
        return None
    call = b.value[ln]
    gamma, beta = (_affine(t, x, b, site) for t in call.args[1:])
    if not (call.attrs.center and call.attrs.scale and _last_axis(call, x.ty.ndim)
            and gamma is not None and beta is not None):
        return None
    return Norm("layer", float(call.attrs.epsilon), gamma, beta), ln, []


def _rms_norm(b: _Bindings, x: relax.Var, site: relax.Var) -> tuple[Norm, relax.Var, list] | None:
    """gamma * (x * r), r = rsqrt(mean(x^2) + eps) or 1 / sqrt(...): x is read by the square and
    the product only, each intermediate by the next step only."""
    readers = b.read_by(x)
    if len(readers) != 2:
        return None
    squares = [v for v in readers if _op(b.value[v], "relax.power") and _scalar(b.value[v].args[1]) == 2.0
               or _op(b.value[v], "relax.multiply") and all(a.same_as(x) for a in b.value[v].args)]
    if len(squares) != 1:
        return None
    (square,), (scaled,) = squares, [v for v in readers if not v.same_as(squares[0])]
    mean = b.only_reader(square, "relax.mean")
    if mean is None or not (b.value[mean].attrs.keepdims and _last_axis(b.value[mean], x.ty.ndim)):
        return None
    shifted = b.only_reader(mean, "relax.add")
    eps = None if shifted is None else next((v for v in map(_scalar, b.value[shifted].args) if v is not None), None)
    if eps is None:
        return None
    steps = [square, mean, shifted]
    rinv = b.only_reader(shifted, "relax.rsqrt")
    if rinv is None:
        root = b.only_reader(shifted, "relax.sqrt")
        rinv = None if root is None else b.only_reader(root, "relax.divide")
        if rinv is None or _scalar(b.value[rinv].args[0]) != 1.0:
            return None
        steps.append(root)
    steps.append(rinv)
    product = b.only_reader(rinv, "relax.multiply")
    if product is None or not product.same_as(scaled):
        return None
    normed = b.only_reader(scaled, "relax.multiply")
    if normed is None:
        return None
    gamma = next((a for a in b.value[normed].args if not a.same_as(scaled)), None)
    gamma = None if gamma is None else _affine(gamma, x, b, site)
    if gamma is None:
        return None
    return Norm("rms", eps, gamma), normed, [*steps, scaled]
