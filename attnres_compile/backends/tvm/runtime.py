"""Loading and running an artifact folder written by artifact.py: numpy in, numpy out, by name."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import tvm
from tvm import relax

from ...core.errors import ArtifactError, InputError, first_line
from . import artifact_checks, fixed_shapes, vm_files
from .cuda_binary import serve_fatbins

FORMAT = "attnres-compile-tvm"
FORMAT_VERSION = 2  # 2: the library's size and SHA-256 are recorded
MANIFEST = "manifest.json"


class Artifact:
    """A loaded artifact: `artifact({"input": array, ...})` -> {"output": array, ...}.

    Inputs are checked against the manifest (names, dtypes, ranks, static dims, and one size
    per symbolic dim); safe dtype casts (int32 -> int64) are applied. A decoder's call that a library
    for fixed shapes fits (`compile --prefill` / `--decode`, fixed_shapes.py) runs there (a prompt
    padded, and its outputs cut back to its length); everything else runs on the main library."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        self.device = tvm.cuda(0) if self.manifest["device"] == "cuda" else tvm.cpu(0)
        if not self.device.exist:
            raise ArtifactError(f"{self.folder}: the artifact runs on {self.manifest['device']}, and this machine has none")
        if "cuda" in self.manifest:
            serve_fatbins(self.folder, self.manifest["cuda"])
        self.vm = self._vm(self.manifest)
        self.fixed = {fixed_shapes.from_entry(kind, e): self._vm(e)
                      for kind in fixed_shapes.KINDS for e in self.manifest.get(kind.KEY, [])}

    def _vm(self, entry: dict) -> relax.VirtualMachine:
        """The VM of the library `entry` records (the manifest, or one of its prefill or decode entries)."""
        path = artifact_checks.library_path(self.folder, entry)  # loading it runs its code: trusted
        try:
            library = vm_files.load(path)
        except Exception as exc:  # noqa: BLE001
            raise ArtifactError(f"{self.folder}: cannot load {entry['library']} ({first_line(exc)})") from None
        return relax.VirtualMachine(library, self.device)

    @property
    def input_names(self) -> list[str]:
        return [i["name"] for i in self.manifest["inputs"]]

    @property
    def output_names(self) -> list[str]:
        return [o["name"] for o in self.manifest["outputs"]]

    def __call__(self, inputs: Mapping[str, np.ndarray] | None = None, **kwargs: np.ndarray) -> dict[str, np.ndarray]:
        given = {**(inputs or {}), **kwargs}
        arrays = self.checked(given)
        feeds = dict(zip(self.input_names, arrays))
        shape = fixed_shapes.choose(list(self.fixed), feeds)
        if shape is None:
            return self._run(self.vm, arrays)
        padded = shape.pad(feeds)
        outputs = self._run(self.fixed[shape], [np.ascontiguousarray(padded[n]) for n in self.input_names])
        return shape.cut(outputs, feeds["input_ids"].shape[1])

    def _run(self, vm: relax.VirtualMachine, arrays: list[np.ndarray]) -> dict[str, np.ndarray]:
        result = vm["main"](*[tvm.runtime.tensor(a, self.device) for a in arrays])
        results = [result] if isinstance(result, tvm.runtime.Tensor) else list(result)
        return {name: r.numpy() for name, r in zip(self.output_names, results)}

    def checked(self, given: Mapping[str, Any]) -> list[np.ndarray]:
        """The inputs in the model's order, checked against the manifest and safely cast (InputError if not)."""
        missing = [n for n in self.input_names if n not in given]
        extra = sorted(set(given) - set(self.input_names))
        if missing or extra:
            raise InputError(f"inputs must be exactly {self.input_names}: missing {missing}, unknown {extra}")
        symbols: dict[str, int] = {}
        arrays = []
        for spec in self.manifest["inputs"]:
            name, shape, dtype = spec["name"], spec["shape"], np.dtype(spec["dtype"])
            array = np.asarray(given[name])
            if array.dtype != dtype:
                if not np.can_cast(array.dtype, dtype, "safe"):
                    raise InputError(f"input {name}: dtype {array.dtype}, expected {dtype}")
                array = array.astype(dtype)
            if shape is not None:
                if array.ndim != len(shape):
                    raise InputError(f"input {name}: shape {list(array.shape)}, expected rank {len(shape)} {shape}")
                for want, got in zip(shape, array.shape):
                    if isinstance(want, int) and want != got:
                        raise InputError(f"input {name}: shape {list(array.shape)}, expected {shape}")
                    if isinstance(want, str) and symbols.setdefault(want, got) != got:
                        raise InputError(f"input {name}: dim {want} is {got} here and {symbols[want]} in another input")
            arrays.append(np.ascontiguousarray(array))
        return arrays


def read_manifest(folder: Path) -> dict:
    """The manifest of the artifact in `folder`, checked for format, fields (artifact_checks) and TVM version."""
    path = folder / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{folder}: not an artifact folder (no {MANIFEST})")
    manifest = artifact_checks.parse(path)
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path}: malformed manifest (not a JSON object)")
    if manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not a {FORMAT} manifest")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        older = isinstance(version, int) and 0 < version < FORMAT_VERSION
        raise ArtifactError(f"{path}: " + (f"written by an older attnres-compile (format {version}): recompile it"
                                           if older else f"not a {FORMAT} v{FORMAT_VERSION} manifest"))
    artifact_checks.check_fields(manifest, path)
    built_with = manifest["versions"]["tvm"]
    if built_with != tvm.__version__:
        raise ArtifactError(f"{folder}: built with TVM {built_with}, this is TVM {tvm.__version__}: recompile it")
    return manifest


def load(folder: str | os.PathLike) -> Artifact:
    """The artifact in `folder`, ready to run: `load(folder)({"idx": tokens})["logits"]`."""
    return Artifact(folder)
