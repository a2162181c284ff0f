"""Where a forward's time goes, by op kind: per-kernel time in the TVM artifact, per-node time in onnxruntime.

Both run at 1 thread in a fresh worker; after a warm-up, RUNS forwards are timed, each call's
fastest time summed by kind. TVM: the Relax VM's instrument hook (backends/tvm/profile.py),
which adds a few microseconds per call; onnxruntime: its session profiler. A TVM kernel's kind is
its name without numeric suffixes; an onnxruntime node's, its op type. `category` maps both onto
CATEGORIES so they read side by side.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from .. import results
from .worker import WorkerError, load_tvm, onnxruntime_options, set_threads

RUNS = 10
VARIANTS = ("original", "full", "block")
RUNTIMES = ("onnxruntime", "tvm", "tvm-tuned")
KERNEL_PREFIX = "attnres_depth_attention"  # backends/tvm/lower.py's kernel names start with it
CATEGORIES = ("depth attention", "matmul", "attention softmax", "norm", "activation", "data movement", "VM builtins",
              "elementwise")
_PATTERNS = (("matmul", r"matmul|gemm|dense|conv"), ("attention softmax", r"softmax|attention"), ("norm", r"norm"),
             ("activation", r"gelu|silu|sigmoid|tanh|relu|erf|swish"))
_MOVES = (r"reshape|transpose|split|concat|gather(nd)?|slice|take|copy|view|expand|(un)?squeeze|strided|broadcast|to"
          r"|cast|shape|identity|flatten|layout|transform|\d+")
TIMEOUT_S = 600
TOP = 15  # kinds per runtime in the text tables (the JSON has all)
WIDTH = 48  # longest kind name shown


def kernel_kind(name: str) -> str:
    """A TVM kernel's kind: the depth-attention kernels as one, others without numeric suffixes."""
    if name.startswith(KERNEL_PREFIX):
        return KERNEL_PREFIX
    return re.sub(r"(?<=[a-z_])\d+(?=_|$)", "", name)


def category(kind: str) -> str:
    """The CATEGORIES entry of a kind of either runtime: a (fused) kernel goes by its heaviest op
    (matmul, softmax, norm, activation, in that order); data movement if it only moves data."""
    if kind.startswith(KERNEL_PREFIX):
        return "depth attention"
    if kind.startswith("vm.builtin"):
        return "VM builtins"
    low = kind.lower()
    found = next((name for name, pattern in _PATTERNS if re.search(pattern, low)), None)
    if found:
        return found
    tokens = [t for t in re.split(r"[_.]", low) if t and t not in ("fused", "tir")]
    return "data movement" if tokens and all(re.fullmatch(_MOVES, t) for t in tokens) else "elementwise"


def tvm_kernels(job: dict) -> dict:
    """{"forward_ms", "kinds": {kind: {"calls", "ms"}}} per forward of the .so job["artifact"]
    (the forwards and their calls timed by backends/tvm/profile.py's `timed_forwards`)."""
    import tvm

    from ...backends.tvm.profile import timed_forwards

    set_threads(1)
    vm, dev = load_tvm(job["artifact"], job["device"])
    with np.load(job["inputs"]) as npz:
        args = [tvm.runtime.tensor(npz[name], dev) for name in npz.files]
    vm["main"](*args)
    forwards = timed_forwards(vm, args, dev, RUNS, clock="wall", forward_clock="cpu")
    runs = [{(i, kernel_kind(name)): t for i, (name, t) in enumerate(f.calls)} for f in forwards]
    return {"forward_ms": min(f.seconds for f in forwards) * 1e3, "kinds": _by_kind(runs)}


def onnxruntime_nodes(job: dict) -> dict:
    """{"forward_ms", "kinds": {op type: {"calls", "ms"}}} per run of the .onnx job["artifact"]."""
    import onnxruntime as ort

    set_threads(1)
    options = onnxruntime_options(1)
    options.enable_profiling = True
    with tempfile.TemporaryDirectory(prefix="attnres-ort-profile-") as tmp:
        options.profile_file_prefix = str(Path(tmp) / "ort")
        session = ort.InferenceSession(job["artifact"], options, providers=["CPUExecutionProvider"])
        with np.load(job["inputs"]) as npz:
            inputs = {name: npz[name] for name in npz.files}
        session.run(None, inputs)
        forwards = []
        for _ in range(RUNS):
            start = time.process_time()
            session.run(None, inputs)
            forwards.append(time.process_time() - start)
        events = json.loads(Path(session.end_profiling()).read_text())
    windows = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                     key=lambda e: e["ts"])[-RUNS:]
    if len(windows) < RUNS:
        raise RuntimeError(f"onnxruntime's profile has {len(windows)} model_run events, expected {RUNS} or more")
    runs: list[dict[tuple[str, str], float]] = [{} for _ in windows]
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            for run, w in zip(runs, windows):
                if w["ts"] <= e["ts"] <= w["ts"] + w["dur"]:
                    run[(e["name"], e["args"]["op_name"])] = e["dur"] / 1e6
    return {"forward_ms": min(forwards) * 1e3, "kinds": _by_kind(runs)}


def _by_kind(runs: list[dict[tuple[Any, str], float]]) -> dict[str, dict]:
    """{kind: {"calls", "ms"}} from RUNS runs of {(call, kind): seconds}: each call's fastest run
    (a busy machine's preemptions land on single calls), summed by kind."""
    best: dict[tuple[Any, str], float] = {}
    for run in runs:
        for key, t in run.items():
            best[key] = min(best.get(key, t), t)
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for (_, kind), t in best.items():
        kinds[kind][0] += 1
        kinds[kind][1] += t
    return {k: {"calls": n, "ms": t * 1e3} for k, (n, t) in kinds.items()}


def profile_variants(variants: list, inputs: Path, s: Any, workers: Any) -> list[dict]:
    """[{"runtime", "variant", "forward_ms", "kinds"} or {..., "error"}] for the original, Full and Block
    in onnxruntime and the TVM build(s) of the run, on the inputs in the .npz `inputs`
    (`variants`: model.Variant, `s`: model.Settings, `workers`: model_worker.Workers)."""
    jobs = {"onnxruntime": (onnxruntime_nodes, "onnx"), "tvm": (tvm_kernels, "tvm"), "tvm-tuned": (tvm_kernels, "tvm-tuned")}
    profiles = []
    for runtime in (r for r in RUNTIMES if r in s.runtimes):
        for v in (v for v in variants if v.name in VARIANTS):
            fn, kind = jobs[runtime]
            artifact = v.files.get(kind)
            entry = {"runtime": runtime, "variant": v.name}
            if s.device != "cpu" and runtime == "onnxruntime":
                entry["error"] = "skipped: profiles are taken on the CPU"
            elif not isinstance(artifact, Path):
                entry["error"] = f"no artifact ({artifact})"
            else:
                try:
                    entry.update(workers.run(fn, {"artifact": str(artifact), "inputs": str(inputs),
                                                  "device": s.device}, TIMEOUT_S))
                except WorkerError as exc:
                    entry["error"] = str(exc)
            profiles.append(entry)
    return profiles


def tables(profiles: list[dict]) -> str:
    """Per model configuration: time by category for each runtime and variant, then each runtime's
    TOP kinds, largest first (ms per forward, 1 thread)."""
    out = []
    configs = dict.fromkeys((p["model"], p["width"], p["sublayers"]) for p in profiles)
    for model, width, sublayers in configs:
        mine = [p for p in profiles if (p["model"], p["width"], p["sublayers"]) == (model, width, sublayers)]
        ok = [p for p in mine if "kinds" in p]
        out.append(f"profile {model} {width}/{sublayers}: ms per forward at 1 thread, by category "
                   f"(TVM: per kernel, VM instrument hook; onnxruntime: per node, its profiler)")
        for p in mine:
            if "error" in p:
                out.append(f"  {p['runtime']} {p['variant']}: {p['error']}")
        if not ok:
            continue
        columns = [("category", "category", "")] + [(f"{p['runtime']} {p['variant']}", f"{p['runtime']} {p['variant']}",
                                                     ".3f") for p in ok]
        rows = []
        for name in CATEGORIES:
            row = {"category": name}
            for p in ok:
                row[f"{p['runtime']} {p['variant']}"] = sum(k["ms"] for kind, k in p["kinds"].items()
                                                            if category(kind) == name)
            rows.append(row)
        rows.append({"category": "sum of calls", **{f"{p['runtime']} {p['variant']}": sum(k["ms"] for k in p["kinds"].values())
                                                    for p in ok}})
        rows.append({"category": "forward (CPU)", **{f"{p['runtime']} {p['variant']}": p["forward_ms"] for p in ok}})
        out += [results.table(rows, columns), ""]
        for runtime in dict.fromkeys(p["runtime"] for p in ok):
            per = [p for p in ok if p["runtime"] == runtime]
            kinds = sorted({k for p in per for k in p["kinds"]}, key=lambda k: -max(p["kinds"].get(k, {"ms": 0})["ms"]
                                                                                   for p in per))
            kind_rows = [{"kind": k if len(k) <= WIDTH else k[:WIDTH - 3] + "...", "category": category(k),
                          **{p["variant"]: p["kinds"][k]["ms"] for p in per if k in p["kinds"]},
                          **{f"{p['variant']} calls": p["kinds"][k]["calls"] for p in per if k in p["kinds"]}}
                         for k in kinds[:TOP]]
            columns = ([("kind", f"{runtime} kind", ""), ("category", "category", "")]
                       + [(p["variant"], f"{p['variant']} ms", ".3f") for p in per]
                       + [(f"{p['variant']} calls", f"{p['variant']} calls", ".0f") for p in per])
            out += [results.table(kind_rows, columns), ""]
    return "\n".join(out).rstrip()
