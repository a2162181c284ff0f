"""Compiled depth-attention kernels for the PyTorch op: built on first use, kept in memory and on disk.

One kernel per tensorir.py function, (arity, rank, feature size, dtype, eps, scale) and target.
The disk cache (ATTNRES_KERNEL_CACHE, else $XDG_CACHE_HOME or ~/.cache under
attnres-compile/kernels) has a folder per TVM version and target, entry names carrying a digest of
the generator's sources. Entries are checked before loading (store.py): a bad one is rebuilt with
one warning line. Loading needs only TVM's runtime.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import platform
import sys
from functools import cache
from pathlib import Path
from typing import NamedTuple

from .store import Folder, Untrusted, location


class Spec(NamedTuple):
    """What a compiled kernel is specialised on."""

    kind: str  # "forward" | "backward" | "backward_chunk" (of a long backward) | "partial" | "partial_link"
    # (continuing a state) | "merge" | "merge_indexed" (the scale and query index arguments)
    count: int  # sources (forward, backward, backward_chunk), completed blocks (partial, partial_link),
    # extra sources (merge, merge_indexed)
    rank: int
    size: int  # feature size D
    dtype: str
    eps: float
    scale: float  # forward, backward, backward_chunk, merge; for partial, partial_link, merge_indexed: the number
    # of queries
    device: str  # "cpu" | "cuda"
    threads: int  # the backward's (and backward_chunk's) row chunks on the CPU (partial query gradients); else 1
    norm: str = ""  # forward_norm, backward_norm (the fused site + norm pair): "<kind>_<eps>_<w><b><g>" (norm_spec)
    # A kind ending in "_delta" (forward, backward, backward_chunk, merge_indexed) is Delta AttnRes' form of it:
    # the plain sum and the gate as arguments (tensorir.py, delta=True).


FUNCTION = {"forward": "depth_attention", "backward": "depth_attention_backward",
            "backward_chunk": "depth_attention_backward_chunk",
            "partial": "depth_attention_partial", "partial_link": "depth_attention_partial",
            "merge": "depth_attention_merge", "merge_indexed": "depth_attention_merge",
            "forward_norm": "depth_attention_norm", "backward_norm": "depth_attention_norm_backward"}
FUNCTION.update({f"{kind}_delta": FUNCTION[kind] for kind in ("forward", "backward", "backward_chunk", "merge_indexed")})
DELTA = "_delta"
PARTIAL_CHUNK = 8  # history sources per compiled partial kernel: a longer history is a chain (partial_links)


def partial_links(bounds: list[int], length: int) -> list[int]:
    """Where the links of a partial chain over `length` history sources start, then `length`: links of
    at most PARTIAL_CHUNK sources, so a few compiled kernels serve every length. The links of `bounds`
    (the previous group's chain over a prefix) are kept, so Full's growing groups reuse the same two
    kernels."""
    if length <= PARTIAL_CHUNK:
        return [0, length]
    kept = [b for b in bounds if b <= length]
    return kept + list(range(kept[-1] + PARTIAL_CHUNK, length, PARTIAL_CHUNK)) + ([length] if kept[-1] < length else [])


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
    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in ("tensorir.py", "schedule.py", "target.py", "tir_pipeline.py"):
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
    from tvm.target import Target

    from .target import host_target

    if device != "cuda":
        return host_target(threads)
    import torch

    major, minor = torch.cuda.get_device_capability()
    return Target({"kind": "cuda", "arch": f"sm_{major}{minor}"}, host=host_target(threads))


def _parts(spec: Spec, threads: str | None = None) -> tuple[str, str]:
    """The subfolders of a kernel's entry: TVM version, device and machine, threads (`threads`: a glob
    pattern in their place)."""
    return (f"tvm-{importlib.metadata.version('apache-tvm')}",
            f"{spec.device}-{_machine(spec.device)}-t{spec.threads if threads is None else threads}")


def holds_size(size: int, dtype: str, device: str = "cpu") -> bool:
    """Whether the configured cache holds any entry of feature size `size` in `dtype` from this
    generator, for this machine at any thread count (unchecked: a load checks it)."""
    probe = Spec("forward", 2, 3, size, dtype, 0.0, 1.0, device, 1)
    try:
        base, parts = location()
    except Untrusted:
        return False
    version, machines = _parts(probe, threads="*")
    return any(base.joinpath(*parts, version).glob(f"{machines}/*_d{size}_{dtype}_*_{_source_digest()}.kernel"))


@cache
def norm_spec(kind: str, eps: float, weight: bool, bias: bool, grad_mixed: bool = False) -> str:
    """Spec.norm of the fused pair's kernels: the norm's kind and eps, which parameters it has (w, b) and,
    for the backward, whether the mixed output has a gradient of its own (g)."""
    return f"{kind}_{float(eps)!r}_{'w' * weight}{'b' * bias}{'g' * grad_mixed}"


def _name(spec: Spec) -> str:
    name = f"{spec.kind}_n{spec.count}_r{spec.rank}_d{spec.size}_{spec.dtype}_{spec.eps!r}_{spec.scale!r}"
    name += f"_{spec.norm}" if spec.norm else ""
    return f"{name}_{_source_digest()}.kernel"


def path(spec: Spec) -> Path:
    """Where the configured cache keeps `spec`'s entry (store.Untrusted if it has no valid location)."""
    base, parts = location()
    return base.joinpath(*parts, *_parts(spec), _name(spec))


def _func(spec: Spec):
    from . import tensorir

    delta = spec.kind.endswith(DELTA)
    kind = spec.kind.removesuffix(DELTA)
    if kind == "forward":
        return tensorir.depth_attention_func(spec.count, spec.size, spec.dtype, spec.eps, spec.scale, spec.rank,
                                             delta=delta)
    if kind in ("backward", "backward_chunk"):
        return tensorir.depth_attention_backward_func(spec.count, spec.size, spec.dtype, spec.eps, spec.scale, spec.rank,
                                                      kind == "backward_chunk", delta)
    if spec.kind in ("partial", "partial_link"):
        return tensorir.depth_attention_partial_func(spec.count, int(spec.scale), spec.size, spec.dtype, spec.eps,
                                                   spec.rank, spec.kind == "partial_link")
    if spec.kind in ("forward_norm", "backward_norm"):
        kind, eps, flags = spec.norm.split("_")
        args = (spec.count, spec.size, spec.dtype, spec.eps, spec.scale, spec.rank, kind, float(eps), "w" in flags, "b" in flags)
        if spec.kind == "forward_norm":
            return tensorir.depth_attention_norm_func(*args)
        return tensorir.depth_attention_norm_backward_func(*args, "g" in flags)
    if kind == "merge_indexed":
        return tensorir.depth_attention_merge_indexed_func(int(spec.scale), spec.count, spec.size, spec.dtype, spec.eps,
                                                           spec.rank, delta=delta)
    return tensorir.depth_attention_merge_func(spec.count, spec.size, spec.dtype, spec.eps, spec.scale, spec.rank)


_MEMORY: dict[Spec, object] = {}
PENDING: dict[Spec, object] = {}  # spec -> the prebuild.Worker building it into the disk cache
_FOLDERS: dict[tuple | None, Folder] = {}  # (base, parts) -> its folder (or the private one); None -> the private one
_WARNED: set[str] = set()


def _folder(spec: Spec) -> Folder:
    """The verified cache folder for `spec`, or the private fallback when the location is refused."""
    try:
        base, parts = location()
    except Untrusted as exc:
        return _private(str(exc))
    key = (base, parts + _parts(spec))
    if key not in _FOLDERS:
        try:
            _FOLDERS[key] = Folder.open(*key)
        except Untrusted as exc:
            _FOLDERS[key] = _private(str(exc))
    return _FOLDERS[key]


def _private(reason: str) -> Folder:
    """This process's private temporary folder, with one warning line per refusal `reason` ("": none)."""
    if reason and reason not in _WARNED:
        _WARNED.add(reason)
        print(f"attnres-compile: not using the kernel cache ({reason}); kernels are built into a private "
              f"temporary folder for this process", file=sys.stderr, flush=True)
    if None not in _FOLDERS:
        _FOLDERS[None] = Folder.private()
    return _FOLDERS[None]


def _cached(folder: Folder, name: str) -> bytes | None:
    """The checked library of entry `name`, or None (absent; refused, with one warning line)."""
    try:
        return folder.read(name)
    except Untrusted as exc:
        print(f"attnres-compile: not loading the cached kernel {folder.path / name} ({exc}); rebuilding it",
              file=sys.stderr, flush=True)
        return None


def _load(folder: Folder, library: bytes, spec: Spec):
    """The kernel's function from `library`, or None: dlopen reads a private copy of exactly these
    bytes, in the cache folder (a read-only one: in a private temporary folder), removed once loaded."""
    try:
        copy = folder.copy(library)
    except OSError:
        folder = _private("")
        copy = folder.copy(library)
    try:
        return runtime().load_module(copy)[FUNCTION[spec.kind]]
    except Exception:
        return None
    finally:
        folder.remove(copy)


def _export(module, folder: Folder) -> bytes | None:
    """The built module as a shared library's bytes (export_library into a private temporary file)."""
    name = folder.temp_name(".so")
    try:
        module.export_library(str(folder.path / name))
        return folder.read_temp(name)
    except Exception as err:  # no C compiler, a full disk: the kernel still runs, from the built module
        print(f"attnres-compile: could not export a kernel to {folder.path} ({err}); it runs uncached",
              file=sys.stderr, flush=True)
        return None
    finally:
        folder.remove(name)


def _store(folder: Folder, name: str, library: bytes) -> None:
    try:
        folder.write(name, library)
    except OSError as err:  # a read-only folder, a full disk: the kernel still runs, uncached
        print(f"attnres-compile: could not cache a kernel in {folder.path} ({err}); it is rebuilt by the next "
              f"process", file=sys.stderr, flush=True)


def cached(spec: Spec) -> bool:
    """Whether the disk cache holds an entry for `spec` (unchecked: a load checks it)."""
    try:
        return path(spec).is_file()
    except Untrusted:
        return False


def _build(spec: Spec, folder: Folder) -> tuple[object, bytes | None]:
    """(the built module, its shared library's bytes stored as `spec`'s entry, or None if not exported)."""
    from .schedule import build

    module = build(_func(spec), target(spec.device, spec.threads))
    library = _export(module, folder)
    if library is not None:
        _store(folder, _name(spec), library)
    return module, library


def build_to_disk(spec: Spec) -> bool:
    """Build `spec` into the disk cache (prebuild.py's workers); False if it could not be stored."""
    folder = _folder(spec)
    return folder.keep and _build(spec, folder)[1] is not None and cached(spec)


def get(spec: Spec):
    """The compiled kernel's function (arguments: torch tensors in the kernel's parameter order)."""
    fn = _MEMORY.get(spec)
    if fn is not None:
        return fn
    if spec.device == "cuda":
        import tvm  # noqa: F401  (its CUDA runtime loads the kernel's device code)
    worker = PENDING.pop(spec, None)
    if worker is not None:  # a prebuild worker builds it: wait for it, then load it as a cached entry
        worker.wait_for(spec)
    folder, name = _folder(spec), _name(spec)
    library = _cached(folder, name)
    fn = _load(folder, library, spec) if library is not None else None
    if fn is None:
        print(f"attnres-compile: compiling the fused depth-attention {spec.kind} kernel ({spec.count} "
              f"{'blocks' if spec.kind.startswith('partial') else 'sources'}, D={spec.size}, {spec.dtype}, {spec.device}); "
              f"cached in {folder.path}", file=sys.stderr, flush=True)
        module, library = _build(spec, folder)
        # the saved library, not the built module: its first call would JIT-compile the code again
        fn = (_load(folder, library, spec) if library is not None else None) or module[FUNCTION[spec.kind]]
    _MEMORY[spec] = fn
    return fn
