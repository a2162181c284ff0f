"""Which input dims a trace keeps dynamic (`--dynamic`, `dynamic=` of the API).

A spec is a comma-separated list of `none`, `batch` (axis 0 of every tensor input), `seq` (axis 1
of rank-2 and rank-3 inputs), `all`, or `INPUT.AXIS`. The default `batch,seq` keeps image sizes
and feature axes static, as fully symbolic shapes break proofs that a branch keeps the skip's
shape (Swin's windows). Chosen dims get `Dim.AUTO`; a note names those the model fixed anyway
(`specialised_note`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..core.errors import ConfigError, first_line

DEFAULT = "batch,seq"
EXPORT_LOGGERS = ("torch._export",)  # "dimension ... 0/1 specialized" when an example's dim is 1 (report: dynamic_dims)
KEYWORDS = ("none", "batch", "seq", "all")


@dataclass(frozen=True)
class DynamicDims:
    """A parsed spec: `batch`, `seq`, `all`, and named (input, axis) pairs."""

    batch: bool = False
    seq: bool = False
    all: bool = False
    named: tuple[tuple[str, int], ...] = ()
    text: str = "none"

    @property
    def none(self) -> bool:
        return not (self.batch or self.seq or self.all or self.named)

    def axes(self, name: str, value: Any) -> list[int]:
        """The dynamic axes of input `name` (holding `value`)."""
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return []
        rank = value.dim()
        if self.all:
            return list(range(rank))
        axes = {a % rank for n, a in self.named if n == name and -rank <= a < rank}
        if self.batch:
            axes.add(0)
        if self.seq and rank in (2, 3):
            axes.add(1)
        return sorted(axes)


def parse(spec: str | None) -> DynamicDims:
    """The DynamicDims of `spec` (None: the default); one clear ConfigError for a bad spec."""
    text = DEFAULT if spec is None else spec.strip()
    tokens = [t.strip() for t in text.split(",") if t.strip()]
    if not tokens:
        raise ConfigError(f"--dynamic {spec!r} is empty: use none, batch, batch,seq, all or INPUT.AXIS")
    flags, named = set(), []
    for token in tokens:
        if token in KEYWORDS:
            flags.add(token)
            continue
        name, dot, axis = token.rpartition(".")
        if not dot or not name or not axis.lstrip("-").isdigit():
            raise ConfigError(f"--dynamic {token!r} is neither one of {', '.join(KEYWORDS)} nor INPUT.AXIS (e.g. input_ids.1)")
        named.append((name, int(axis)))
    if "none" in flags and (len(flags) > 1 or named):
        raise ConfigError(f"--dynamic {text!r}: 'none' cannot be combined with other dims")
    return DynamicDims("batch" in flags, "seq" in flags, "all" in flags, tuple(named), ",".join(tokens))


def _input_names(model: Any, args: tuple) -> list[str]:
    """Names of the positional inputs: the forward's parameter names where it has them, else arg0, arg1, ..."""
    try:
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError, AttributeError):
        params = []
    return [params[i].name if i < len(params) else f"arg{i}" for i in range(len(args))]


def export_spec(dims: DynamicDims, model: Any, args: tuple, kwargs: dict) -> tuple | dict | None:
    """`dynamic_shapes` for torch.export (None when every dim is static): a tuple for positional inputs,
    a dict for keyword-only ones or both. A named dim must name an input (ConfigError).
    """
    names = _input_names(model, args)
    known = set(names) | set(kwargs)
    unknown = sorted({n for n, _ in dims.named} - known)
    if unknown:
        raise ConfigError(f"--dynamic names input {unknown[0]!r}; the model's inputs are {', '.join(sorted(known))}")
    if dims.none:
        return None

    def spec(name: str, value: Any):
        axes = dims.axes(name, value)
        return {a: torch.export.Dim.AUTO for a in axes} if axes else None

    positional = tuple(spec(n, a) for n, a in zip(names, args))
    keyword = {k: spec(k, v) for k, v in kwargs.items()}
    if not kwargs:
        return positional
    if not args:
        return keyword
    if any(n.startswith("arg") and n[3:].isdigit() for n in names):
        return None  # positional inputs without names cannot be combined with keywords: trace static
    return {**dict(zip(names, positional)), **keyword}


def size_one_note(dims: DynamicDims, model: Any, args: tuple, kwargs: dict) -> list[str]:
    """A note for dims asked dynamic whose example size is 0 or 1: torch.export makes those static."""
    inputs = {**dict(zip(_input_names(model, args), args)), **kwargs}
    fixed = [f"{name}[{axis}]" for name, value in inputs.items() for axis in dims.axes(name, value)
             if value.shape[axis] < 2]
    if not fixed:
        return []
    return [f"{', '.join(fixed)} stay static: their example size is 0 or 1, which torch.export specialises "
            "(give examples of size >= 2 for dynamic dims)"]


def specialised_note(dims: DynamicDims, model: Any, args: tuple, kwargs: dict, gm: torch.fx.GraphModule) -> list[str]:
    """A note for dims asked dynamic (example size >= 2) that the trace made static anyway: a
    shape guard set their symbol to a constant (FalconMamba's scan loops over the sequence,
    Funnel's position table is built for it); names them, their size and where torch.export
    specialised them."""
    shape_env = next((n.meta["val"].fake_mode.shape_env for n in gm.graph.nodes
                      if n.op == "placeholder" and hasattr(n.meta.get("val"), "fake_mode")), None)
    if shape_env is None:
        return []
    inputs = {**dict(zip(_input_names(model, args), args)), **kwargs}
    kept = traced_dims(gm)
    fixed = [(f"{name}[{axis}]", value.shape[axis]) for name, value in inputs.items() for axis in dims.axes(name, value)
             if value.shape[axis] >= 2 and axis not in kept.get(name, [])]
    specialised = {s for s, r in shape_env.replacements.items() if r.is_number}
    where = next((f" at {g.sloc.maybe_user_loc or str(g.sloc)[1:-1]}" for g in shape_env.guards
                  if _sets_constant(g.expr) and g.expr.free_symbols & specialised), "")
    if not fixed or not shape_env.var_to_sources:
        return []  # nothing asked became static, or the export fell back to static shapes (noted there)
    sizes = "/".join(sorted({str(size) for _, size in fixed}))
    return [f"{', '.join(n for n, _ in fixed)} stay static (size {sizes}): torch.export specialised them{where} "
            "(the result takes only these sizes)"]


def _sets_constant(expr) -> bool:
    """A guard `Eq(s, 8)`: it fixes a symbol to a constant (not `Eq(s0, s1)`, which unifies two)."""
    return expr.is_Relational and expr.rel_op == "==" and any(side.is_number for side in expr.args)


def traced_dims(gm: torch.fx.GraphModule) -> dict[str, list[int]]:
    """{input name: its symbolic axes} of a traced GraphModule (inputs with static shapes omitted)."""
    out = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor):
            axes = [i for i, d in enumerate(val.shape) if isinstance(d, torch.SymInt) and d.node.maybe_as_int() is None]
            if axes:
                out[node.name] = axes
    return out


def export_program(model: torch.nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any, what: str,
                   notes: list[str]) -> torch.export.ExportedProgram:
    """torch.export with `dynamic_shapes`; when that fails, once more with static shapes and a
    one-line note in `notes` (`what` names the dims asked for, e.g. "dynamic batch,seq")."""
    args, kwargs = dense(args, kwargs)
    try:
        with quiet_loggers(EXPORT_LOGGERS):
            return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as exc:  # noqa: BLE001 - any tracer failure with symbolic dims is retried static
        if dynamic_shapes is None:
            raise
        with quiet_loggers(EXPORT_LOGGERS):
            program = torch.export.export(model, args, kwargs, strict=False)
        notes.append(f"torch.export with {what} failed ({first_line(exc, 160)}); traced with static shapes: "
                     "the result takes only the example's shapes")
        return program


def dense(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The inputs with every non-contiguous tensor made contiguous (same values): torch.export gives a
    sliced input's stride (`ids[:, :6]` of [2, 8]: stride 8) a symbol of its own with no range, and
    torch's decompositions in TVM's importer then fail ("vr must not be None for symbol s55", mBART)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t if t.is_contiguous() else t.contiguous(), (args, kwargs))


@contextlib.contextmanager
def quiet_loggers(names: tuple[str, ...]):
    """Third-party log lines below ERROR hidden inside our own calls (the API as the CLI hides them),
    the loggers' levels restored after."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
