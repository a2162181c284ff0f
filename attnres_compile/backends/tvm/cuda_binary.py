"""CUDA device code of an artifact: the source, a fatbin compiled here, and serving it at load.
TVM exports CUDA modules as source, compiled at load through `tvm_callback_cuda_compile`. The
artifact also carries a fatbin per device module, compiled here with nvcc (no GPU needed), and
`serve_fatbins` answers that callback with it, so the target machine needs the CUDA driver only.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import tvm
import tvm_ffi

from ...core.errors import ArtifactError, CompileError, first_line

CALLBACK = "tvm_callback_cuda_compile"
_served: dict[str, Path] = {}  # sha256 of a device source -> its fatbin
_fallback = None  # TVM's callback, once ours is installed


def device_sources(executable: tvm.runtime.Executable) -> list[str]:
    """The CUDA source of each device module the executable imports."""
    sources, stack, seen = [], [executable.mod], set()
    while stack:
        for child in stack.pop().imports:
            if child.kind == "cuda" and child.inspect_source() not in seen:
                seen.add(child.inspect_source())
                sources.append(child.inspect_source())
            stack.append(child)
    return sources


def write_device_code(executable: tvm.runtime.Executable, folder: Path, target: tvm.target.Target) -> list[dict]:
    """device<i>.cu, and device<i>.fatbin (SASS for the target's arch) when nvcc is on PATH, for
    each device module; returns their manifest entries (file names, the source's sha256)."""
    from tvm.support import nvcc

    entries = []
    for i, source in enumerate(device_sources(executable)):
        entry = {"source": f"device{i}.cu", "fatbin": None, "sha256": _digest(source)}
        (folder / entry["source"]).write_text(source)
        if shutil.which("nvcc"):
            try:
                with target:  # nvcc.compile_cuda reads the arch from the current target
                    fatbin = nvcc.compile_cuda(source, target_format="fatbin", compiler="nvcc")
            except Exception as exc:  # noqa: BLE001
                raise CompileError(f"nvcc could not compile the generated CUDA source: {first_line(exc)}") from None
            entry["fatbin"] = f"device{i}.fatbin"
            (folder / entry["fatbin"]).write_bytes(bytes(fatbin))
        entries.append(entry)
    return entries


def serve_fatbins(folder: Path, entries: list[dict]) -> None:
    """Make the runtime's CUDA compile callback return this artifact's fatbins for its sources."""
    global _fallback
    from tvm.support import nvcc  # noqa: F401  (registers TVM's callback, kept as the fallback)

    for entry in entries:
        if entry["fatbin"]:
            path = folder / entry["fatbin"]
            if not path.is_file():
                raise ArtifactError(f"{folder}: {entry['fatbin']} is missing")
            _served[entry["sha256"]] = path
    if _fallback is None:
        _fallback = tvm_ffi.get_global_func(CALLBACK)
        tvm_ffi.register_global_func(CALLBACK, _compile, override=True)


def _compile(code: str, *rest) -> bytes:
    path = _served.get(_digest(code))
    return path.read_bytes() if path is not None else _fallback(code, *rest)


def _digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()
