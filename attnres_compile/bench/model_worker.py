"""Load one saved model artifact and run it: in-process for timing, or as a memory-measuring worker.

`runner` turns an artifact (.pt2 for torch eager, .onnx for onnxruntime, .so or an in-memory
executable for TVM) into a forward call; model.py times those calls. Run as a module,

    python -m attnres_compile.bench.model_worker RUNTIME ARTIFACT INPUTS.npz --device cpu --threads 2

it loads the artifact in a fresh process, runs one warm-up forward, resets the peak and runs
one more, and prints JSON: the forward's peak (above the RSS before it, or the CUDA allocator's
peak for eager on cuda) and the process's peak RSS over its whole life (load included).

For the measurement the runtimes are set to give memory back after each forward: onnxruntime
without its arena, TVM's naive allocator, and (the caller's environment) glibc with a fixed
mmap threshold and MKL without its buffer pool. Otherwise the warm-up's buffers stay resident
and the measured forward appears to need nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

Call = Callable[[], Any]
ToNumpy = Callable[[Any], np.ndarray]


class Unavailable(Exception):
    """A runtime that cannot run this variant here; the message is what the benchmark's row says."""


def runner(runtime: str, artifact: Any, inputs: dict[str, np.ndarray], device: str, threads: int,
           release: bool = False) -> tuple[Call, ToNumpy]:
    """(call, to_numpy): `call()` runs one forward of `artifact` on `inputs`, `to_numpy(out)` reads its output.

    `release` configures the runtime to free its buffers after each forward (for memory)."""
    if runtime == "eager":
        return _eager(artifact, inputs, device)
    if runtime == "onnxruntime":
        return _onnxruntime(artifact, inputs, device, threads, release)
    if runtime == "tvm":
        return _tvm(artifact, inputs, device, release)
    raise ValueError(f"unknown runtime {runtime!r}")


def _eager(artifact: Any, inputs: dict[str, np.ndarray], device: str) -> tuple[Call, ToNumpy]:
    """A .pt2 program (or a module) called under no_grad."""
    import torch

    import attnres_compile  # noqa: F401  (registers torch.ops.attnres before the program is loaded)

    module = torch.export.load(str(artifact)).module() if isinstance(artifact, (str, Path)) else artifact
    args = tuple(torch.from_numpy(a).to(device) for a in inputs.values())

    def call():
        with torch.no_grad():
            return module(*args)
    return call, lambda out: out.detach().cpu().numpy()


def onnxruntime_providers(device: str) -> list[str]:
    """The execution providers for `device`; raises Unavailable when onnxruntime cannot use it."""
    import onnxruntime as ort

    if device == "cpu":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise Unavailable("skipped: this onnxruntime has no CUDAExecutionProvider (pip install onnxruntime-gpu)")
    return ["CUDAExecutionProvider"]


def _onnxruntime(path: Path, inputs: dict[str, np.ndarray], device: str, threads: int,
                 release: bool) -> tuple[Call, ToNumpy]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    options.enable_cpu_mem_arena = not release
    session = ort.InferenceSession(str(path), options, providers=onnxruntime_providers(device))
    return (lambda: session.run(None, inputs)), (lambda out: out[0])


def _tvm(artifact: Any, inputs: dict[str, np.ndarray], device: str, release: bool) -> tuple[Call, ToNumpy]:
    """A .so exported by `executable.export_library` (or the executable itself); inputs in order."""
    import tvm
    from tvm import relax

    dev = tvm.cuda(0) if device == "cuda" else tvm.cpu(0)
    module = tvm.runtime.load_module(str(artifact)) if isinstance(artifact, (str, Path)) else artifact
    vm = relax.VirtualMachine(module, dev, memory_cfg="naive" if release else None)
    main = vm["main"]
    args = [tvm.runtime.tensor(a, dev) for a in inputs.values()]

    def to_numpy(out):
        return (out if isinstance(out, tvm.runtime.Tensor) else out[0]).numpy()
    return (lambda: main(*args)), to_numpy


def measure(runtime: str, artifact: Path, inputs: dict[str, np.ndarray], device: str, threads: int) -> dict:
    """Warm-up forward, then the peak of one more forward and of the whole process (bytes)."""
    from . import memory

    call, _ = runner(runtime, artifact, inputs, device, threads, release=True)
    call()
    if device == "cuda":
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runtime", choices=["eager", "onnxruntime", "tvm"])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("inputs", type=Path, help=".npz of the inputs, in the model's argument order")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    with np.load(args.inputs) as npz:
        inputs = {name: npz[name] for name in npz.files}
    print(json.dumps(measure(args.runtime, args.artifact, inputs, args.device, args.threads)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
