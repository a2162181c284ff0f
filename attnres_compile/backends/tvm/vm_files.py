"""Saving and loading a Relax VM library without TVM's log line per constant.
TVM writes a `Warning: Scope Saving/Loaded:` line per constant straight to fd 2; these calls hold
fd 2 on a scratch file meanwhile and pass every other line on afterwards.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import tvm

_SCOPE_LINE = re.compile(rb"^[^\n]*executable\.cc:\d+: Warning: Scope (?:Saving|Loaded):[^\n]*\n?", re.M)


def save(executable, path: str | os.PathLike) -> None:
    """executable.export_library(path), without the per-constant lines."""
    with _scope_lines_dropped():
        executable.export_library(str(path))


def load(path: str | os.PathLike | Path):
    """tvm.runtime.load_module(path), without the per-constant lines."""
    with _scope_lines_dropped():
        return tvm.runtime.load_module(str(path))


@contextlib.contextmanager
def _scope_lines_dropped() -> Iterator[None]:
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as scratch:
        os.dup2(scratch.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            scratch.seek(0)
            rest = memoryview(_SCOPE_LINE.sub(b"", scratch.read()))
            while rest:
                rest = rest[os.write(2, rest):]
