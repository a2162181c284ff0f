"""Stage lines with elapsed times on a terminal (progress.py): shown by the CLI when stderr is a
TTY (a pseudo-terminal here), never through a pipe or a file, never by API calls."""

import io
import os
import re
import threading

import pytest

from attnres_compile.utils import progress
from tests.forked_cli import run_cli
from tests.test_cli import chain_model


def _read(master: int) -> str:
    chunks = []
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: every writer of the terminal has closed it
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode().replace("\r\n", "\n")


def _cli_on_terminal(argv: list) -> tuple[int, str]:
    """main(argv) in a forked child (forked_cli) whose stderr is a pseudo-terminal: its exit code and terminal text."""
    master, slave = os.openpty()
    try:
        run = run_cli(argv, setup=lambda: os.dup2(slave, 2))
    finally:
        os.close(slave)
    text = _read(master)
    os.close(master)
    assert not run.timed_out and run.stderr == "", run
    return run.code, text


def _steps(text: str) -> list[str]:
    return [s for s, _ in re.findall(r"^attnres-compile: (.+) \.\.\. (\d+\.\d) s$", text, re.MULTILINE)]


def test_cli_shows_each_long_step_on_a_terminal(tmp_path):
    code, text = _cli_on_terminal(["rewrite", "samples.models:gpt_factory", "-o", tmp_path / "g.pt2"])
    assert code == 0 and _steps(text) == ["tracing", "verifying in torch", "exporting g.pt2"], text
    assert text.count("\n") == 3, text  # nothing else: library output stays hidden
    code, text = _cli_on_terminal(["rewrite", chain_model(tmp_path / "c.onnx", feature=8), "-o", tmp_path / "r.onnx"])
    assert code == 0 and _steps(text) == ["analysing c.onnx", "verifying in onnxruntime"], text
    assert text.count("\n") == 2, text


@pytest.fixture
def terminal(monkeypatch):
    """sys.__stderr__ on a pseudo-terminal; yields a function returning what reached it so far."""
    master, slave = os.openpty()
    stream = open(slave, "w")
    monkeypatch.setattr("sys.__stderr__", stream)
    yield lambda: (stream.close(), _read(master))[1]
    os.close(master)


def test_stage_lines_nested_and_failed(terminal):
    threads = threading.active_count()
    with progress.on_terminal():
        with progress.stage("outer"):
            with progress.stage("inner"):
                pass
        with pytest.raises(ValueError), progress.stage("failing"):
            raise ValueError("x")
        with progress.stage("tuning", lines_follow=True):
            print("tune: a line of its own", file=progress.sys.__stderr__)
    assert threading.active_count() == threads
    lines = re.sub(r"\d+\.\d s", "T s", terminal()).splitlines()
    assert lines == ["attnres-compile: outer ...", "attnres-compile: inner ... T s", "attnres-compile: outer: T s",
                     "attnres-compile: failing ... stopped after T s", "attnres-compile: tuning ...",
                     "tune: a line of its own", "attnres-compile: tuning: T s"]


def test_silent_for_api_calls_and_without_a_terminal(terminal, monkeypatch):
    with progress.stage("an API call"):  # outside on_terminal: the CLI did not ask
        pass
    assert terminal() == ""
    piped = io.StringIO()
    monkeypatch.setattr("sys.__stderr__", piped)
    with progress.on_terminal(), progress.stage("piped"):
        pass
    assert piped.getvalue() == ""
