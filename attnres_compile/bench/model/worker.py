"""Measurements of saved model artifacts, each in a fresh worker process.

`runner` turns an artifact (.pt2, .onnx, .so) into a call and a reader of its outputs. Jobs run
in `Workers`, processes forked from a server that has imported the runtimes and run nothing, so
each starts fresh without paying the imports: `time_candidates` (checked, then timed in
interleaved rounds) and `measure_memory` (the RSS a call adds after a warm-up, with every
runtime's caching allocators off so the warm-up's buffers are not reused). A job's native log
lines go to a log file; a failed job is reported by its last line.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ...core.errors import first_line

Call = Callable[[], Any]
Outputs = Callable[[Any], dict[str, np.ndarray]]
RUNTIMES = ("eager", "train", "onnxruntime", "tvm")
RTOL = 1e-4  # preserve mode is exact up to float32 summation order: |diff| <= RTOL * (1 + max|ref|)
PRELOAD = ["numpy", "torch", "onnxruntime", "tvm", "tvm.relax", "attnres_compile",
           # what torch.export.load imports on first use (sympy among them): about 1 s per worker otherwise
           "torch._export.serde.serialize", "torch.fx.experimental.symbolic_shapes", "torch.export.pt2_archive",
           "torch.export._unlift"]
M_MMAP_THRESHOLD = -3  # mallopt parameter: buffers above it are mmapped, and unmapped when freed


class Unavailable(Exception):
    """A runtime that cannot run this variant here; the message is what the benchmark's row says."""


class WorkerError(Exception):
    """A job that failed, crashed or timed out in its worker; the message is one line."""


# ---------------------------------------------------------------- runners

def runner(runtime: str, artifact: str | Path, inputs: dict[str, np.ndarray], device: str, threads: int,
           release: bool = False) -> tuple[Call, Outputs]:
    """(call, outputs): `call()` runs `artifact` once on `inputs`, `outputs(result)` reads its result as
    named arrays ("logits"; for "train" the loss and the gradient of every parameter).

    `release` configures the runtime to free its buffers after each call (for memory)."""
    if runtime in ("eager", "train"):
        return _torch(artifact, inputs, device, train=runtime == "train")
    if runtime == "onnxruntime":
        return _onnxruntime(artifact, inputs, device, threads, release)
    if runtime == "tvm":
        return _tvm(artifact, inputs, device, release)
    raise ValueError(f"unknown runtime {runtime!r}")


_programs: dict[tuple, Any] = {}  # (.pt2 path, train) -> its module, loaded once per worker


def _torch(path: str | Path, inputs: dict[str, np.ndarray], device: str, train: bool) -> tuple[Call, Outputs]:
    """A .pt2 program: the forward under no_grad, in the form for eager inference (`two_phase`:
    sites over a long shared history as partial + merges), or (train) one training step without the
    optimizer, on the program as saved: forward, next-token cross-entropy of the logits, backward
    into every parameter's .grad."""
    import torch

    import attnres_compile  # registers torch.ops.attnres before the program is loaded

    key = (str(path), train)
    if key not in _programs:
        module = torch.export.load(str(path)).module()
        _programs[key] = module if train else attnres_compile.two_phase(module).graph_module
    module = _programs[key]
    args = tuple(torch.from_numpy(a).to(device) for a in inputs.values())
    if not train:
        def forward():
            with torch.no_grad():
                return module(*args)
        return forward, lambda out: {"logits": out.detach().cpu().numpy()}

    labels = torch.roll(args[0], -1, dims=-1)  # next token (the last position predicts the first: fixed, fine)
    params = dict(module.named_parameters())

    def step():
        logits = module(*args)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        loss.backward()
        grads = {name: p.grad for name, p in params.items() if p.grad is not None}
        for p in params.values():
            p.grad = None  # each step allocates its gradients, as with zero_grad(set_to_none=True)
        return loss.detach(), grads

    def outputs(out):
        loss, grads = out
        return {"loss": loss.cpu().numpy(), **{f"grad {n}": g.cpu().numpy() for n, g in grads.items()}}
    return step, outputs


def onnxruntime_providers(device: str) -> list[str]:
    """The execution providers for `device`; raises Unavailable when onnxruntime cannot use it."""
    import onnxruntime as ort

    if device == "cpu":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise Unavailable("skipped: this onnxruntime has no CUDAExecutionProvider (pip install onnxruntime-gpu)")
    return ["CUDAExecutionProvider"]


def onnxruntime_options(threads: int, release: bool = False):
    """SessionOptions: `threads` intra-op threads (1: the work runs in the calling thread), quiet."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.enable_cpu_mem_arena = not release
    return options


def _onnxruntime(path: str | Path, inputs: dict[str, np.ndarray], device: str, threads: int,
                 release: bool) -> tuple[Call, Outputs]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), onnxruntime_options(threads, release),
                                   providers=onnxruntime_providers(device))
    return (lambda: session.run(None, inputs)), (lambda out: {"logits": out[0]})


def load_tvm(path: str | Path, device: str, memory_cfg: str | None = None):
    """(virtual machine, device) for a .so written by measure.py (for CUDA with its device code beside it)."""
    import tvm
    from tvm import relax

    from ...backends.tvm import vm_files

    path = Path(path)
    if device == "cuda":
        import json

        from ...backends.tvm.cuda_binary import serve_fatbins

        serve_fatbins(path.parent, json.loads(path.with_suffix(".cuda.json").read_text()))
    dev = tvm.cuda(0) if device == "cuda" else tvm.cpu(0)
    return relax.VirtualMachine(vm_files.load(path), dev, memory_cfg=memory_cfg), dev


def _tvm(path: str | Path, inputs: dict[str, np.ndarray], device: str, release: bool) -> tuple[Call, Outputs]:
    """The exported library's main, inputs in order, already on the device."""
    import tvm

    vm, dev = load_tvm(path, device, "naive" if release else None)
    main = vm["main"]
    args = [tvm.runtime.tensor(a, dev) for a in inputs.values()]

    def outputs(out):
        return {"logits": (out if isinstance(out, tvm.runtime.Tensor) else out[0]).numpy()}
    return (lambda: main(*args)), outputs


def set_threads(threads: int) -> None:
    """Every runtime's thread count, in a worker before any runtime starts its pool. TVM's idle workers
    sleep instead of spinning (as in kernels/fused.py): they share the process with onnxruntime's
    original, and spinning through the other runtime's turn would slow both."""
    import torch

    os.environ["TVM_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(threads)  # TVM reads it at its pool's start
    os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")
    torch.set_num_threads(threads)


def compare(outputs: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> dict:
    """{"max_abs_err", "error"}: each expected array against the output of the same name, within
    RTOL * (1 + max |expected|) (scaled per array: a gradient is compared at its own magnitude)."""
    worst, error = 0.0, None
    for name, ref in expected.items():
        if name not in outputs or outputs[name].shape != ref.shape:
            return {"max_abs_err": None, "error": f"output {name!r} missing or of another shape"}
        err = float(np.abs(outputs[name].astype(np.float64) - ref).max(initial=0.0))
        tol = RTOL * (1 + float(np.abs(ref).max(initial=0.0)))
        worst = max(worst, err)
        if err > tol and error is None:
            error = f"{name} differs: max abs {err:.3g} > tolerance {tol:.3g}"
    return {"max_abs_err": worst, "error": error}


# ---------------------------------------------------------------- jobs (run in a worker)

def time_candidates(job: dict) -> dict:
    """Check then time job["candidates"] ([{name, runtime, artifact, check}]) at job["threads"]:
    `check` names the candidate whose outputs this one must match, or "reference" (job["reference"],
    an .npz of expected arrays). Returns {"samples": {name: {clock: [s per call per round]}},
    "checks": {name: compare(...)}, "threads_seen": threads of the process after timing}."""
    from .. import timing

    set_threads(job["threads"])
    inputs = _load_npz(job["inputs"])
    reference = _load_npz(job["reference"])
    calls, outputs = {}, {}
    for c in job["candidates"]:
        call, read = runner(c["runtime"], c["artifact"], inputs, job["device"], job["threads"])
        calls[c["name"]], outputs[c["name"]] = call, read(call())
    checks = {}
    for c in job["candidates"]:
        expected = reference if c["check"] == "reference" else outputs[c["check"]]
        checks[c["name"]] = compare(outputs[c["name"]], {k: v for k, v in expected.items() if k in outputs[c["name"]]}
                                    if c["check"] == "reference" else expected)
    del outputs
    samples = timing.interleaved_clocks(calls, job["rounds"], job["min_time"], timing.sync_for(job["device"]))
    return {"samples": samples, "checks": checks, "threads_seen": len(os.listdir("/proc/self/task"))}


def measure_memory(job: dict) -> dict:
    """Warm-up call of job["artifact"] on job["runtime"], then the bytes the next call adds to the RSS
    (or, on CUDA for torch, to the allocator) and the process's peak RSS over the job."""
    from .. import memory

    set_threads(job["threads"])
    os.environ["MKL_DISABLE_FAST_MM"] = "1"  # read at MKL's first allocation: its pool would keep the warm-up's buffers
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024)  # fixed: big buffers are unmapped when freed
    memory.reset_peak()
    call, _ = runner(job["runtime"], job["artifact"], _load_npz(job["inputs"]), job["device"], job["threads"],
                     release=True)
    call()
    if job["device"] == "cuda" and job["runtime"] in ("eager", "train"):
        return _measure_cuda(call) | {"peak_rss_bytes": memory.peak_bytes()}
    lifetime = memory.peak_bytes()
    forward = memory.forward_peak(call)
    return {"forward_peak_bytes": forward, "peak_rss_bytes": max(lifetime, memory.peak_bytes())}


def _measure_cuda(call: Call) -> dict:
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    return {"forward_peak_bytes": torch.cuda.max_memory_allocated() - before}


def _load_npz(path: str | Path) -> dict[str, np.ndarray]:
    with np.load(path) as npz:
        return {name: npz[name] for name in npz.files}


# ---------------------------------------------------------------- workers

class Workers:
    """Runs jobs in fresh processes forked from a server that has imported the runtimes (PRELOAD)
    and run nothing: `run(job_function, job, timeout)` -> its result, or raises WorkerError."""

    def __init__(self, logs: Path):
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(PRELOAD)  # no effect once the server runs: it has them then
        self.logs = logs
        self.count = itertools.count()

    def start(self) -> None:
        """Start the server now, so that its imports overlap with the caller's work."""
        from multiprocessing import forkserver

        forkserver.ensure_running()

    def run(self, fn: Callable[[dict], Any], job: dict, timeout: float) -> Any:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{next(self.count):04d}-{fn.__name__}.log"
        receive, send = self.context.Pipe(duplex=False)
        process = self.context.Process(target=_job, args=(send, fn, job, str(log), timeout), daemon=True)
        process.start()
        send.close()
        with _closing(process):
            try:
                result = receive.recv() if receive.poll(timeout + 10) else ("timeout", None)
            except EOFError:  # the worker died without a word
                process.join(10)
                result = ("crash", process.exitcode)
        if result[0] == "ok":
            return result[1]
        if result[0] == "error":
            raise WorkerError(result[1])
        if result[0] == "timeout" or result[1] == -signal.SIGALRM:
            raise WorkerError(f"worker timed out after {timeout:.0f} s")
        raise WorkerError(f"worker exited {result[1]}: {_last_line(log)}")


@contextlib.contextmanager
def _closing(process) -> Iterator[None]:
    try:
        yield
    finally:
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join()


def _job(send, fn: Callable[[dict], Any], job: dict, log: str, timeout: float) -> None:
    """In the worker: output to `log`, a SIGALRM after `timeout` s, the result or one error line to `send`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    signal.alarm(max(int(timeout), 1))
    try:
        result = ("ok", fn(job))
    except Exception as exc:  # noqa: BLE001 - one line for the row; the traceback is in the log
        import traceback

        traceback.print_exc()
        result = ("error", first_line(exc))
    send.send(result)


def _last_line(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no output"
    return lines[-1][:300] if lines else "no output"
