"""What `load` and `run` check before they load an artifact's library, and which folder `compile` may replace (`artifact_output`).

Loading the library runs its code, so an artifact folder is trusted code (docs/tvm.md, *Trust
model*). These checks turn a damaged or malformed folder into one ArtifactError line (exit 14)
and keep the manifest from pointing the loader elsewhere: every key the runtime reads, with its
type; the library a plain, regular (non-symlink) file of the folder with the recorded size and
SHA-256. The hash guards against damage, not against someone who can write the folder.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from dataclasses import fields
from pathlib import Path

import numpy as np

from ...core.errors import ArtifactError, ConfigError, first_line
from ...utils.outputs import Output
from .fixed_shapes import KINDS, check_decoder

MAX_MANIFEST_BYTES = 64 << 20  # a manifest is kilobytes; this bounds what a read takes in
_SHA256 = re.compile(r"[0-9a-f]{64}")


def artifact_output(out: Path, option: str = "-o") -> Output:
    """An artifact folder as an output: only a folder holding `manifest.json` (runtime.MANIFEST) is ours
    to replace (outputs.check)."""
    return Output(out, option, folder=True, marker="manifest.json")


def parse(path: Path) -> object:
    """The JSON in `path` (ArtifactError if unreadable, too large, not JSON, or nested too deeply)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            raise ValueError(f"larger than {MAX_MANIFEST_BYTES >> 20} MiB")
        return json.loads(data)
    except RecursionError:
        raise ArtifactError(f"{path}: unreadable manifest (nested too deeply)") from None
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{path}: unreadable manifest ({first_line(exc)})") from None


def check_fields(manifest: dict, path: Path) -> None:
    """ArtifactError naming the first key the runtime reads that is missing or of the wrong type."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ArtifactError(f"{path}: malformed manifest ({what})")

    need(isinstance(manifest.get("versions"), dict) and isinstance(manifest["versions"].get("tvm"), str),
         "versions.tvm must be a string")
    need(plain_name(manifest.get("library")), "library must be a file name inside the artifact folder")
    need(isinstance(manifest.get("library_size"), int) and manifest["library_size"] >= 0,
         "library_size must be a byte count")
    need(isinstance(manifest.get("library_sha256"), str) and _SHA256.fullmatch(manifest["library_sha256"]),
         "library_sha256 must be 64 hex digits")
    need(manifest.get("device") in ("cpu", "cuda"), "device must be cpu or cuda")
    for io in ("inputs", "outputs"):
        entries = manifest.get(io)
        need(isinstance(entries, list) and all(isinstance(e, dict) for e in entries), f"{io} must be a list of objects")
        for i, entry in enumerate(entries):
            need(isinstance(entry.get("name"), str), f"{io}[{i}].name must be a string")
            shape = entry.get("shape")
            need(shape is None or (isinstance(shape, list) and all(
                d is None or isinstance(d, str) or (isinstance(d, int) and not isinstance(d, bool) and d >= 0)
                for d in shape)), f"{io}[{i}].shape must be null or a list of sizes, names and nulls")
            need(entry.get("dtype") is None or _dtype(entry["dtype"]), f"{io}[{i}].dtype must be a numpy dtype")
    fixed = {kind: manifest.get(kind.KEY, []) for kind in KINDS}
    for kind, entries in fixed.items():
        key, sizes = kind.KEY, [f.name for f in fields(kind)]
        need(isinstance(entries, list) and all(isinstance(e, dict) for e in entries), f"{key} must be a list of libraries")
        for i, entry in enumerate(entries):
            need(all(_count(entry.get(k), 1) for k in sizes),
                 f"{key}[{i}] must give a {' and a '.join(sizes)} of at least 1")
            need(plain_name(entry.get("library")) and entry["library"] != manifest["library"],
                 f"{key}[{i}].library must be a file name inside the artifact folder, not the main library")
            need(_count(entry.get("library_size"), 0) and isinstance(entry.get("library_sha256"), str)
                 and _SHA256.fullmatch(entry["library_sha256"]), f"{key}[{i}] must record the library's size and SHA-256")
    if any(fixed.values()):
        try:
            check_decoder([e["name"] for e in manifest["inputs"]], [e["name"] for e in manifest["outputs"]])
        except ConfigError:
            need(False, "prefill and decode libraries are for a decoder with past, and this model is not one")
    cuda = manifest.get("cuda", [])
    need(isinstance(cuda, list) and all(isinstance(e, dict) and isinstance(e.get("sha256"), str)
                                        and (e.get("fatbin") is None or plain_name(e["fatbin"])) for e in cuda),
         "cuda must list device modules with a sha256 and a fatbin file name or null")


def _count(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def plain_name(name: object) -> bool:
    """Whether `name` names a file directly inside a folder (no separator, not `.` or `..`)."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def library_path(folder: Path, manifest: dict) -> Path:
    """folder/library, once it is a regular file (not a symlink) of the recorded size and SHA-256."""
    name = manifest["library"]
    try:
        fd = os.open(folder / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ArtifactError(f"{folder}: {name} is missing") from None
    except OSError as exc:
        why = "is a symlink (refused)" if exc.errno == errno.ELOOP else f"cannot be read ({exc.strerror})"
        raise ArtifactError(f"{folder}: {name} {why}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ArtifactError(f"{folder}: {name} is not a regular file")
        if st.st_size != manifest["library_size"]:
            raise ArtifactError(f"{folder}: {name} has {st.st_size} bytes where the manifest records "
                                f"{manifest['library_size']} (truncated or replaced): recompile it")
        sha256 = _sha256(f)
    if sha256 != manifest["library_sha256"]:
        raise ArtifactError(f"{folder}: {name} does not match the SHA-256 its manifest records (damaged or "
                            "replaced): recompile it")
    return folder / name


def record(path: Path) -> dict:
    """The manifest's record of the library at `path`: `library_size`, `library_sha256`."""
    with open(path, "rb") as f:
        return {"library_size": os.fstat(f.fileno()).st_size, "library_sha256": _sha256(f)}


def _sha256(f) -> str:
    digest = hashlib.sha256()
    while chunk := f.read(1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def _dtype(text: object) -> bool:
    try:
        np.dtype(text)
    except (TypeError, ValueError):
        return False
    return isinstance(text, str)
