"""`attnres-compile` runs as forked children of the (already imported) test process.

A forked `cli.main` is the CLI as a user runs it (its own process, its own exit status and file
descriptors 1 and 2, signals, native crashes and hangs contained) at a few milliseconds of
start-up instead of seconds of imports, which is what lets the fuzz tests run thousands of cases.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Run:
    """A finished run: `code` (None when a signal ended it: `signal`), its output, its wall time."""

    argv: list
    code: int | None
    signal: int | None
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False
    lines: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.lines = self.stderr.strip().splitlines()


_WARM = False


def warm() -> None:
    """Import, once in this process, everything a command imports lazily (the CLI's parser pulls in
    TVM; rewrite, pt2, monitor, plots, onnxruntime), so that forked runs start at once."""
    global _WARM
    if _WARM:
        return
    import importlib

    from attnres_compile.cli import parser

    parser.build()
    for name in ("attnres_compile.onnx.pipeline", "attnres_compile.api", "attnres_compile.pt2", "attnres_compile.monitor",
                 "attnres_compile.utils.plots", "attnres_compile.onnx.runtime", "attnres_compile.backends.tvm.artifact",
                 "onnxruntime.tools.symbolic_shape_infer", "matplotlib.pyplot"):
        importlib.import_module(name)
    _WARM = True


def run_cli(argv: list, cwd: str | os.PathLike | None = None, timeout: float = 120.0, env: dict | None = None,
            send: tuple[int, float] | None = None, setup=None) -> Run:
    """`main(argv)` in a forked child (cwd, extra environment); `send=(signal, seconds)` signals it
    after that long; `setup()` runs in the child first (resource limits, fault injection). A run
    past `timeout` is killed (timed_out)."""
    warm()
    argv = [str(a) for a in argv]
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    start = time.monotonic()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # main unblocks them
    pid = os.fork()
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    else:
        code = 1
        try:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if cwd is not None:
                os.chdir(cwd)
            os.environ.update(env or {})
            if setup is not None:
                setup()
            import torch

            torch.set_num_threads(1)  # the parent's OpenMP pool does not survive a fork
            from attnres_compile.cli import main

            code = main(argv)
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 2
        except BaseException:  # noqa: BLE001 - an escape from main is a failure the caller sees (code 99)
            import traceback

            traceback.print_exc()
            code = 99
        finally:  # a signal after main returned would kill the bare child, not a CLI run
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001
                    pass
            os._exit(code)
    timed_out = False
    sent = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        elapsed = time.monotonic() - start
        if send and not sent and elapsed >= send[1]:
            os.kill(pid, send[0])
            sent = True
        if elapsed > timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            timed_out, status = True, None
            break
        time.sleep(0.005)
    seconds = time.monotonic() - start
    texts = []
    for f in (out, err):
        f.seek(0)
        texts.append(f.read().decode("utf-8", "replace"))
        f.close()
    if status is None:
        return Run(argv, None, signal.SIGKILL, *texts, seconds, timed_out=True)
    if os.WIFSIGNALED(status):
        return Run(argv, None, os.WTERMSIG(status), *texts, seconds, timed_out)
    return Run(argv, os.WEXITSTATUS(status), None, *texts, seconds, timed_out)


def leftovers(root: Path) -> list[Path]:
    """Staging folders and temporary files under `root` (what no run may leave behind)."""
    return sorted(p for p in Path(root).rglob("*") if p.name.startswith(".") and (".tmp" in p.name or p.name.endswith(".old")))
