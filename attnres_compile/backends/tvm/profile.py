"""Per-kernel time of a compiled model: every call the Relax VM makes, timed through its instrument hook.

`timed_forwards` is the one timing loop (also bench/model/profile.py's). `profile(model, inputs)`
sums the calls per function name on the process CPU clock (`clock="cpu"`) or the wall clock;
`overhead_pct` compares the instrumented forward with a plain one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tvm
from tvm import relax

from . import vm_files
from .lower import KERNEL_PREFIX

CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def load_vm(model: Any, device: str = "cpu") -> tuple[relax.VirtualMachine, tvm.runtime.Device, list[str] | None]:
    """A VM for an artifact folder (with its input names), an exported .so, an executable or a module."""
    dev = tvm.cuda(0) if device == "cuda" else tvm.cpu(0)
    names = None
    if isinstance(model, (str, os.PathLike)) and Path(model).is_dir():
        from .artifact_checks import library_path
        from .runtime import read_manifest

        manifest = read_manifest(Path(model))
        names = [i["name"] for i in manifest["inputs"]]
        model = library_path(Path(model), manifest)
    if isinstance(model, (str, os.PathLike)):
        model = vm_files.load(model)
    return relax.VirtualMachine(model, dev), dev, names


@dataclass
class Forward:
    """One timed forward: its time and, when instrumented, every VM call as (function name, seconds), in order."""

    seconds: float
    calls: list[tuple[str, float]] = field(default_factory=list)


def timed_forwards(vm: relax.VirtualMachine, args: Sequence, dev: tvm.runtime.Device, repeat: int,
                   clock: str = "cpu", instrument: bool = True, forward_clock: str | None = None) -> list[Forward]:
    """`repeat` forwards of vm["main"](*args), each timed on `forward_clock` (default `clock`); with
    `instrument`, each VM call timed on `clock` through the VM's instrument hook (synchronised on a GPU)."""
    for name in (clock, forward_clock or clock):
        if name not in CLOCKS:
            raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {name!r}")
    now, whole = CLOCKS[clock], CLOCKS[forward_clock or clock]
    sync = dev.sync if dev.type != "cpu" else (lambda: None)
    calls: list[tuple[str, float]] = []
    started: list[float] = []

    def hook(func, symbol, before_run, ret_value, *call_args):
        if before_run:
            started.append(now())
        else:
            sync()
            calls.append((str(symbol), now() - started.pop()))
        return 0  # VMInstrumentReturnKind.NO_OP

    forward, forwards = vm["main"], []
    if instrument:
        vm.set_instrument(tvm.runtime.convert(hook))
    try:
        for _ in range(repeat):
            start = whole()
            forward(*args)
            dev.sync()
            forwards.append(Forward(whole() - start, calls.copy()))
            calls.clear()
    finally:
        if instrument:
            vm.set_instrument(None)
    return forwards


def profile(model: Any, inputs: Mapping[str, np.ndarray] | Sequence[np.ndarray], device: str = "cpu",
            repeat: int = 10, warmup: int = 2, clock: str = "cpu") -> dict:
    """Per-function time of `model`'s forward on `inputs`: {"clock", "repeat", "forward_ms",
    "instrumented_ms", "overhead_pct", "rows": [{"name", "kind", "calls", "ms", "share"}]}, rows by
    time, per forward; `kind` is "depth-attention", "builtin" or "operator"."""
    vm, dev, names = load_vm(model, device)
    arrays = [inputs[n] for n in names] if names and isinstance(inputs, Mapping) else list(
        inputs.values() if isinstance(inputs, Mapping) else inputs)
    args = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in arrays]
    timed_forwards(vm, args, dev, warmup, clock, instrument=False)
    plain = timed_forwards(vm, args, dev, repeat, clock, instrument=False)
    instrumented = timed_forwards(vm, args, dev, repeat, clock)
    totals: dict[str, list[float]] = {}
    for name, t in (call for f in instrumented for call in f.calls):
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += t
    timed = sum(t for _, t in totals.values())
    rows = sorted(({"name": name, "kind": _kind(name), "calls": calls / repeat, "ms": t / repeat * 1e3,
                    "share": t / timed if timed else 0.0} for name, (calls, t) in totals.items()),
                  key=lambda r: -r["ms"])
    base = float(np.median([f.seconds for f in plain])) * 1e3
    inst = float(np.median([f.seconds for f in instrumented])) * 1e3
    return {"clock": clock, "repeat": repeat, "forward_ms": base, "instrumented_ms": inst,
            "overhead_pct": (inst / base - 1) * 100 if base else 0.0, "rows": rows}


def _kind(name: str) -> str:
    if name.startswith(KERNEL_PREFIX):
        return "depth-attention"
    return "builtin" if name.startswith("vm.") else "operator"


def format_table(result: dict, top: int | None = 25) -> str:
    """The profile as a text table: time per forward, share, calls, kind, name. The `top` costliest
    rows and every depth-attention kernel (the ones the rewrite adds, whatever their rank: on a
    small model they can rank below the top) are listed, the rest summed in one line."""
    listed = [not top or i < top or r["kind"] == "depth-attention" for i, r in enumerate(result["rows"])]
    rows = [r for r, keep in zip(result["rows"], listed) if keep]
    rest = [r for r, keep in zip(result["rows"], listed) if not keep]
    lines = [f"per-kernel time ({result['clock']} clock, mean of {result['repeat']} forwards): "
             f"forward {result['forward_ms']:.3f} ms, instrumented {result['instrumented_ms']:.3f} ms "
             f"({result['overhead_pct']:+.0f}%)",
             f"{'ms':>9} {'share':>6} {'calls':>6}  {'kind':<15} name"]
    lines += [f"{r['ms']:9.3f} {r['share'] * 100:5.1f}% {r['calls']:6.0f}  {r['kind']:<15} {r['name']}" for r in rows]
    if rest:
        lines.append(f"{sum(r['ms'] for r in rest):9.3f} {sum(r['share'] for r in rest) * 100:5.1f}% "
                     f"{sum(r['calls'] for r in rest):6.0f}  ({len(rest)} more)")
    return "\n".join(lines)
