"""Stage lines for the long steps (trace, export, verification, TVM build, tuning) on a terminal.
`with stage("verifying in onnxruntime"):` writes `attnres-compile: verifying in onnxruntime ...`,
then the elapsed time on the same line. Only inside `on_terminal()` and when stderr is a TTY;
no thread. The stream is sys.__stderr__, which the CLI keeps while it hides library output."""

from __future__ import annotations

import contextlib
import sys
import time

PREFIX = "attnres-compile: "
_state = {"on": False, "open": False}  # stages shown; a stage's line waits for its time (no newline yet)


@contextlib.contextmanager
def on_terminal():
    """Show stages for the duration, if stderr is a terminal."""
    stream = sys.__stderr__
    previous = _state["on"]
    _state["on"] = bool(stream is not None and stream.isatty())
    try:
        yield
    finally:
        _state["on"] = previous


@contextlib.contextmanager
def stage(what: str, lines_follow: bool = False):
    """A stage line around the step in the block; `lines_follow`: the step prints lines of its own
    (tuning), so the stage line ends at once and its time comes on a line of its own."""
    stream = sys.__stderr__
    if not _state["on"]:
        yield
        return
    if _state["open"]:  # an enclosing stage's line: end it, its time comes on a line of its own
        _write(stream, "\n")
    _write(stream, f"{PREFIX}{what} ..." + ("\n" if lines_follow else ""))
    _state["open"] = not lines_follow
    start = time.monotonic()
    done = "stopped after "
    try:
        yield
        done = ""
    finally:
        took = f"{done}{time.monotonic() - start:.1f} s"
        _write(stream, f" {took}\n" if _state["open"] else f"{PREFIX}{what}: {took}\n")
        _state["open"] = False


def _write(stream, text: str) -> None:
    with contextlib.suppress(Exception):  # a closed or broken terminal never fails the command
        stream.write(text)
        stream.flush()
