"""What a file is, in words, for errors about a file of the wrong type ("x.onnx is an ONNX model,
not a .pt2 archive"). Decided from the file's type (a FIFO is never opened), the first bytes and,
for zip files, the entry names."""

from __future__ import annotations

import io
import os
import stat
import zipfile
from pathlib import Path

from ..core.errors import InputError

_SPECIAL = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
            (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"))


def special(path: str | os.PathLike, follow: bool = True) -> str | None:
    """What `path` is when it exists and is not a regular file ("a folder", "a FIFO (named pipe)",
    "a character device", ...; with follow=False a symlink counts as a file), else None."""
    try:
        mode = os.stat(path).st_mode if follow else os.lstat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
        return None
    return next((kind for test, kind in _SPECIAL if test(mode)), "not a regular file")


def check_file(path: str | os.PathLike, wanted: str) -> None:
    """InputError unless `path` is a regular file (or a symlink to one): "no such file", or what it is
    instead ("x.onnx is a FIFO (named pipe), not an ONNX model"), before anything opens it."""
    kind = special(path)
    if kind:
        raise InputError(f"{path} is {kind}, not {wanted}: give the path of a file")
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file")


def describe(source: str | os.PathLike | io.BytesIO) -> str:
    """"an ONNX model", "a .pt2 archive (torch.export program)", "an .npz archive of arrays",
    "a zip archive", "a text file", "an empty file", "a folder", ... (never raises)."""
    try:
        if isinstance(source, io.BytesIO):
            head = source.getvalue()[:4096]
            name = ""
        else:
            path = Path(source)
            kind = special(path)
            if kind:
                return kind
            if not path.exists():
                return "a missing file"
            with path.open("rb") as f:
                head = f.read(4096)
            name = path.name.lower()
        if not head:
            return "an empty file"
        if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
            return _zip_kind(source)
        if _looks_like_onnx(head) or head.startswith(b"\x08") and name.endswith(".onnx"):
            return "an ONNX model"
        for magic, kind in ((b"\x93NUMPY", "a NumPy .npy array"), (b"\x89PNG", "a PNG image"),
                            (b"\x7fELF", "a compiled library or program"), (b"\x80", "a Python pickle")):
            if head.startswith(magic):
                return kind
        try:
            if b"\0" in head:  # valid UTF-8, but no text file holds NUL bytes
                raise UnicodeDecodeError("utf-8", head, 0, 1, "NUL byte")
            head.decode("utf-8")
            return "a JSON file" if head.lstrip()[:1] in (b"{", b"[") else "a text file"
        except UnicodeDecodeError:
            return "a binary file of unknown type"
    except OSError:
        return "an unreadable file"


_MODEL_FIELDS = {0x12, 0x1a, 0x22, 0x2a, 0x32, 0x3a, 0x42, 0x4a, 0x52, 0x5a, 0x62, 0x72, 0x7a}


def _looks_like_onnx(head: bytes) -> bool:
    """A ModelProto starts with field 1 (ir_version, a varint), then another of its fields."""
    if not head.startswith(b"\x08"):
        return False
    i = 1
    while i < len(head) and i < 11 and head[i] & 0x80:
        i += 1
    return i + 1 < len(head) and head[i + 1] in _MODEL_FIELDS


def _zip_kind(source) -> str:
    try:
        with zipfile.ZipFile(source) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, RuntimeError, NotImplementedError):
        return "a damaged zip archive"
    if names and all(n.endswith(".npy") for n in names):
        return "an .npz archive of arrays"
    if any(n.endswith("/archive_format") or n.endswith("/models/model.json") for n in names):
        return "a .pt2 archive (torch.export program)"
    if any(n.endswith("data.pkl") for n in names):
        return "a torch.save checkpoint"
    return "a zip archive"


ATTNRES_SECTION = "attnres"  # config.json's section of a saved AttnRes checkpoint (hf/checkpoint.py writes it)


def folder_kind(path: str | os.PathLike) -> str:
    """What a saved model folder is, from its config.json alone (nothing imported, nothing run):
    "attnres" (an AttnRes checkpoint: the `attnres` section) or "hf" (a Hugging Face model);
    InputError in one line for a folder that is neither."""
    import json

    where = Path(path)
    config = where / "config.json"
    if not config.is_file():
        raise InputError(f"{where} is neither a Hugging Face checkpoint nor an AttnRes one (no config.json)")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise InputError(f"{where} is neither a Hugging Face checkpoint nor an AttnRes one (config.json: "
                         f"{type(exc).__name__})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise InputError(f"{where} is neither a Hugging Face checkpoint nor an AttnRes one (config.json names no "
                         "model_type)")
    return "attnres" if ATTNRES_SECTION in data else "hf"
