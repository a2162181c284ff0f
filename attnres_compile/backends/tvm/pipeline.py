"""Imported model -> executable: bind shapes, lower the sites, optimize, optionally tune, compile.

The sites are lowered first (lower.py), so later passes see opaque, already-scheduled kernels.
`prepare` then rewrites small powers to products, attention scores to read the keys in place
(rewrites.KeysInPlace), on CPU applies FastMath (before legalization) and the scan cumsum
(cumsum.py), then legalizes and fuses. `schedule` gives every operator a default schedule
(cpu_rules.py on CPU, gpu_rules.py on CUDA; an unlowerable one passes to the next rule,
lowerable.py), after tune.py's records where tuning ran.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from typing import TextIO

import tvm
from tvm import relax
from tvm.target import Target

from ...core.errors import CompileError, ConfigError, first_line
from ...kernels import tir_pipeline
from ...kernels.target import host_target
from . import cpu_rules, gpu_rules
from .cumsum import LegalizeCumsum
from .importers import ImportedModel
from .lower import KERNEL_PREFIX, PARTIAL_PREFIX, LowerDepthAttention, calls
from .rewrites import (
    ExpandSigmoid,
    FastMath,
    KeysInPlace,
    RewritePowers,
    RootBlocks,
    ScalarsIntoTirVars,
    WrapTakeIndices,
)
from .sites import DELTA_PACKED_NAME, PACKED_NAME

TARGETS = ("llvm", "cuda")
DEFAULT_ARCH = "sm_90"


@dataclass
class Built:
    """The compiled executable, the module it was compiled from (lowered, before the build
    pipeline), the target, the lowered sites and, when tuned, the tuning summary."""

    executable: tvm.runtime.Executable
    mod: tvm.IRModule
    target: Target
    sites: list[dict]
    tuning: dict | None


def make_target(kind: str, arch: str | None = None) -> Target:
    """llvm: this machine's CPU, all its cores; cuda: `arch` (default sm_90) with an llvm host."""
    host = host_target(os.cpu_count() or 1)
    if kind == "llvm":
        if arch:
            raise ConfigError("--arch applies to --target cuda only")
        return host
    if kind == "cuda":
        arch = arch or DEFAULT_ARCH
        if not arch.startswith("sm_"):
            raise ConfigError(f"--arch must look like sm_90, got {arch!r}")
        return Target({"kind": "cuda", "arch": arch}, host=host)
    raise ConfigError(f"--target must be one of {', '.join(TARGETS)}, got {kind!r}")


def bind_shapes(model: ImportedModel, shapes: dict[str, tuple[int, ...]] | None) -> tvm.IRModule:
    """Fix the symbolic input dims named by `shapes` ({input name: dims}); the others stay symbolic."""
    if not shapes:
        return model.mod
    params = dict(zip(model.inputs, model.mod["main"].params))
    unknown = sorted(set(shapes) - set(params))
    if unknown:
        raise ConfigError(f"--static-shape names unknown input {unknown[0]!r}; the model's inputs are {model.inputs}")
    binding: dict[tvm.tirx.Var, int] = {}
    for name, dims in shapes.items():
        declared = list(params[name].ty.shape.values)
        if len(dims) != len(declared):
            raise ConfigError(f"--static-shape {name}: {len(dims)} dims given, the input has rank {len(declared)}")
        for d, size in zip(declared, dims):
            if isinstance(d, tvm.tirx.IntImm) and int(d) != size:
                raise ConfigError(f"--static-shape {name}: dim {int(d)} is static, got {size}")
            if isinstance(d, tvm.tirx.Var) and binding.setdefault(d, size) != size:
                raise ConfigError(f"--static-shape gives {d.name} two sizes: {binding[d]} and {size}")
    return relax.transform.BindSymbolicVars(binding, "main")(model.mod)


def static_shape_hint(model: ImportedModel, shapes: dict[str, tuple[int, ...]] | None) -> str:
    """The way out of a failure that dims known only at run time may cause (TVM's shape arithmetic
    gives up on some symbolic extents where their values would do): a `--static-shape` per input
    with symbolic dims not fixed yet, each such dim written as {its name}; '' when there is none."""
    flags = []
    for name, param in zip(model.inputs, model.mod["main"].params):
        dims = param.ty.shape.values if isinstance(getattr(param.ty, "shape", None), relax.ShapeExpr) else []
        if name not in (shapes or {}) and any(not isinstance(d, tvm.tirx.IntImm) for d in dims):
            flags.append(f"--static-shape {name}:" + "x".join(str(int(d)) if isinstance(d, tvm.tirx.IntImm)
                                                                else f"{{{d}}}" for d in dims))
    return (f"; its inputs have dims known only at run time: fixing them may help ({' '.join(flags)}, with the "
            "sizes to compile for)" if flags else "")


def lower(mod: tvm.IRModule, target: Target, expected_sites: int) -> tuple[tvm.IRModule, list[dict]]:
    """Every placeholder to one kernel call; checks that none is left and each site has its call."""
    lowering = LowerDepthAttention(target)
    mod = lowering(mod)
    counted = calls(mod)
    left = counted[f"packed:{PACKED_NAME}"] + counted[f"packed:{DELTA_PACKED_NAME}"]
    kernel_calls = sum(n for name, n in counted.items()  # one site kernel per site, partials aside
                       if name.startswith(KERNEL_PREFIX) and not name.startswith(PARTIAL_PREFIX))
    if left or kernel_calls != expected_sites or len(lowering.lowered) != expected_sites:
        raise CompileError(f"lowering left {left} depth-attention placeholder(s) and made {kernel_calls} kernel "
                           f"call(s) for {expected_sites} site(s)")
    return mod, lowering.lowered


def prepare(mod: tvm.IRModule, target: Target) -> tvm.IRModule:
    """Relax rewrites, legalization and fusion: the fused operators the schedules (or the tuner) see.
    Constants and weights are marked layout-free, so a schedule may pre-pack them."""
    cpu = target.kind.name == "llvm"
    passes = [RewritePowers(), WrapTakeIndices(), KeysInPlace(), *([ExpandSigmoid(), FastMath(), LegalizeCumsum()] if cpu else []),
              *relax.pipeline.library_dispatch_passes(target),
              relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(),
              relax.transform.FuseOps(), ScalarsIntoTirVars(), relax.transform.FuseTIR(),
              relax.transform.RewriteDataflowReshape(), relax.transform.DeadCodeElimination()]
    if cpu:
        passes += [relax.transform.CanonicalizeBindings(), relax.transform.AttachAttrLayoutFreeBuffers()]
    with target:
        return tvm.transform.Sequential(passes)(mod)


def schedule(mod: tvm.IRModule, target: Target) -> tvm.IRModule:
    """Default schedules for every operator not scheduled yet; on CPU, weights pre-packed at compile time."""
    from tvm.s_tir import dlight

    if target.kind.name == "llvm":
        passes = [dlight.ApplyDefaultSchedule(*cpu_rules.default_rules()), RootBlocks(),
                  relax.transform.SplitLayoutRewritePreproc(),
                  relax.transform.FoldConstant(), relax.transform.DeadCodeElimination()]
    else:
        passes = [dlight.ApplyDefaultSchedule(*gpu_rules.default_rules())]
    with target:
        return tvm.transform.Sequential(passes)(mod)


def finish(target: Target) -> tvm.transform.Pass:
    """TVM's standard lowering of a scheduled module to VM code (tvm.compile's relax_pipeline; TVM 0.27's
    `relax.pipeline.dataflow_lower_passes` fails for llvm, so its four passes are listed here)."""
    return tvm.transform.Sequential([relax.transform.RewriteDataflowReshape(), relax.transform.ToNonDataflow(),
                                     relax.transform.RemovePurityChecking(), relax.transform.CallTIRRewrite(),
                                     *relax.pipeline.finalize_passes(target)])


def build(model: ImportedModel, target: Target, *, input_shapes: dict | None = None, tune: bool = False,
          trials: int | None = None, tune_minutes: float | None = None, tuning_db: str | os.PathLike | None = None,
          progress: TextIO | None = None) -> Built:
    """Compile `model` for `target` with the default schedules; with `tune`, meta_schedule first
    (CPU, static shapes) for `trials` trials per operator and/or `tune_minutes` minutes in all,
    starting from the default schedules, into `tuning_db` (a temporary folder when None)."""
    mod = bind_shapes(model, input_shapes)
    mod, sites = lower(mod, target, len(model.sites))
    summary = None
    try:
        mod = prepare(mod, target)
    except Exception as exc:  # noqa: BLE001 - TVM's errors carry the reason on their first line
        raise CompileError(f"TVM could not legalize the model for {target.kind.name}: {first_line(exc).rstrip('.')}"
                           f"{static_shape_hint(model, input_shapes)}") from None
    if tune:
        from . import tune as tuning  # meta_schedule's runner needs psutil and cloudpickle

        with contextlib.ExitStack() as stack:
            db = tuning_db if tuning_db is not None else stack.enter_context(tempfile.TemporaryDirectory())
            summary = tuning.tune(mod, target, db, trials=trials, minutes=tune_minutes, progress=progress).to_dict()
            mod = tuning.apply(mod, target, db)
    try:
        mod = schedule(mod, target)
        executable = tvm.compile(mod, target, relax_pipeline=finish(target), tir_pipeline=tir_pipeline.NAME)
    except Exception as exc:  # noqa: BLE001 - TVM's errors carry the reason on their first line
        raise CompileError(f"TVM could not build the model for {target.kind.name}: {first_line(exc).rstrip('.')}"
                           f"{static_shape_hint(model, input_shapes)}") from None
    return Built(executable, mod, target, sites, summary)
