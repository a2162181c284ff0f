"""Compiled depth-attention kernels for the PyTorch op: built on first use, kept in memory and on disk.

A kernel is one of kernel.py's functions (forward, backward, partial, merge) for one (arity,
rank, feature size, dtype, eps, scale), scheduled and compiled for one target. The disk cache is
a folder of shared libraries (ATTNRES_KERNEL_CACHE, else $XDG_CACHE_HOME/attnres-compile/kernels,
else ~/.cache/attnres-compile/kernels), in a subfolder per TVM version and target, one file per
kernel named for its parameters and a digest of the kernel generator's source (kernel.py,
schedule.py): a new version of either never loads an old binary. Files are written atomically
(a temporary file renamed into place), and an entry that fails to load is rebuilt and replaced.
A build prints one line on stderr.

Loading a cached CPU kernel needs only TVM's runtime library (tvm_ffi plus libtvm_runtime,
a tenth of a second); the compiler (`import tvm`, seconds) is imported for a build only.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import sys
import tempfile
from functools import cache
from pathlib import Path
from typing import NamedTuple


class Spec(NamedTuple):
    """What a compiled kernel is specialised on."""

    kind: str  # "forward" | "backward" | "partial" | "partial_link" (continuing a state) | "merge"
    count: int  # sources (forward, backward), completed blocks (partial, partial_link), extra sources (merge)
    rank: int
    size: int  # feature size D
    dtype: str
    eps: float
    scale: float  # forward, backward, merge; for partial and partial_link: the number of queries
    device: str  # "cpu" | "cuda"
    threads: int  # the backward's row chunks on the CPU (its partial query gradients); else 1


FUNCTION = {"forward": "depth_attention", "backward": "depth_attention_backward",
            "partial": "depth_attention_partial", "partial_link": "depth_attention_partial",
            "merge": "depth_attention_merge"}
PARTIAL_CHUNK = 8  # history sources per compiled partial kernel: a longer history is a chain (partial_links)


def partial_links(bounds: list[int], length: int) -> list[int]:
    """Where the links of a partial chain over `length` history sources start, then `length`: the
    fused kernels (TVM lowering, the eager op) read a long history as a chain of partials over at
    most PARTIAL_CHUNK sources, each continuing the last one's state, so a few small compiled
    kernels serve every length. The links of `bounds` (the previous group's chain, over a prefix of
    this history) are kept: Full's groups grow by their size, so each chain is the one before plus
    one link of the same length, and two kernels serve them all (GPT-2 Full at 48 sublayers: links
    of 8 and 7). A history of at most PARTIAL_CHUNK sources is one link."""
    if length <= PARTIAL_CHUNK:
        return [0, length]
    kept = [b for b in bounds if b <= length]
    return kept + list(range(kept[-1] + PARTIAL_CHUNK, length, PARTIAL_CHUNK)) + ([length] if kept[-1] < length else [])


def cache_dir() -> Path:
    if os.environ.get("ATTNRES_KERNEL_CACHE"):
        return Path(os.environ["ATTNRES_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "attnres-compile" / "kernels"


@cache
def runtime():
    """tvm_ffi with TVM's runtime library loaded (what a compiled kernel calls into); the CUDA
    runtime comes with the full `import tvm`."""
    import tvm_ffi

    if "tvm" not in sys.modules:
        from tvm_ffi.libinfo import load_lib_ctypes

        lib = Path(importlib.util.find_spec("tvm").submodule_search_locations[0]) / "lib"
        load_lib_ctypes("tvm", "tvm_runtime", "RTLD_GLOBAL", extra_lib_paths=[lib])
    return tvm_ffi


def installed() -> bool:
    """Whether TVM is installed (without importing it)."""
    return importlib.util.find_spec("tvm") is not None and importlib.util.find_spec("tvm_ffi") is not None


@cache
def _source_digest() -> str:
    """Digest of the code that generates and schedules the kernels."""
    here = Path(__file__).parent / "backends" / "tvm"
    h = hashlib.sha256()
    for name in ("kernel.py", "schedule.py", "tir_pipeline.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


@cache
def _machine(device: str) -> str:
    """What the target depends on, read without TVM: the CPU model and its features (LLVM's host
    CPU follows from them), and the GPU's compute capability."""
    cpu = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo") as f:
            cpu += [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        pass
    if device == "cuda":
        import torch

        cpu.append("sm_{}{}".format(*torch.cuda.get_device_capability()))
    return hashlib.sha256("".join(cpu).encode()).hexdigest()[:16]


def target(device: str, threads: int):
    """The TVM target for `device`: this CPU with `threads` cores, or this machine's GPU (its
    sm_XY) with that CPU as host."""
    import torch
    from tvm.target import Target

    from .backends.tvm.schedule import host_target

    if device != "cuda":
        return host_target(threads)
    major, minor = torch.cuda.get_device_capability()
    return Target({"kind": "cuda", "arch": f"sm_{major}{minor}"}, host=host_target(threads))


def path(spec: Spec) -> Path:
    folder = f"{spec.device}-{_machine(spec.device)}-t{spec.threads}"
    name = f"{spec.kind}_n{spec.count}_r{spec.rank}_d{spec.size}_{spec.dtype}_{spec.eps!r}_{spec.scale!r}"
    return cache_dir() / f"tvm-{importlib.metadata.version('apache-tvm')}" / folder / f"{name}_{_source_digest()}.so"


def _func(spec: Spec):
    from .backends.tvm import kernel

    if spec.kind == "forward":
        return kernel.depth_attention_func(spec.count, spec.size, spec.dtype, spec.eps, spec.scale, spec.rank)
    if spec.kind == "backward":
        return kernel.depth_attention_backward_func(spec.count, spec.size, spec.dtype, spec.eps, spec.scale, spec.rank)
    if spec.kind in ("partial", "partial_link"):
        return kernel.depth_attention_partial_func(spec.count, int(spec.scale), spec.size, spec.dtype, spec.eps,
                                                   spec.rank, spec.kind == "partial_link")
    return kernel.depth_attention_merge_func(spec.count, spec.size, spec.dtype, spec.eps, spec.scale, spec.rank)


def _load(file: Path, spec: Spec):
    """The kernel's function from a cached library, or None (absent, damaged, foreign)."""
    if not file.exists():
        return None
    try:
        return runtime().load_module(str(file))[FUNCTION[spec.kind]]
    except Exception:
        return None


def _save(module, file: Path) -> None:
    """Write the library next to its final name, then rename it into place (atomic)."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".so", dir=file.parent)
        os.close(fd)
        try:
            module.export_library(tmp)
            os.replace(tmp, file)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except Exception as err:  # no C compiler, a read-only folder: the kernel still runs, uncached
        print(f"attnres-compile: could not cache a kernel in {file.parent} ({err}); it is rebuilt by the next "
              f"process", file=sys.stderr)


_MEMORY: dict[Spec, object] = {}


def get(spec: Spec):
    """The compiled kernel's function (arguments: torch tensors in the kernel's parameter order)."""
    fn = _MEMORY.get(spec)
    if fn is not None:
        return fn
    if spec.device == "cuda":
        import tvm  # noqa: F401  (its CUDA runtime loads the kernel's device code)
    file = path(spec)
    fn = _load(file, spec)
    if fn is None:
        from .backends.tvm.schedule import build

        print(f"attnres-compile: compiling the fused depth-attention {spec.kind} kernel ({spec.count} "
              f"{'blocks' if spec.kind.startswith('partial') else 'sources'}, D={spec.size}, {spec.dtype}, {spec.device}); "
              f"cached in {cache_dir()}", file=sys.stderr, flush=True)
        module = build(_func(spec), target(spec.device, spec.threads))
        _save(module, file)
        # the saved library, not the built module: its first call would JIT-compile the code again
        fn = _load(file, spec) or module[FUNCTION[spec.kind]]
    _MEMORY[spec] = fn
    return fn
