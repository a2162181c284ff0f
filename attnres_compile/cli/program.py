"""The `attnres-compile` program: parse, check every output and input before any work, run the command.
Every failure is one stderr line and a documented exit code (docs/cli.md); outputs are staged
(utils/outputs.py); library logs are hidden unless --debug; Ctrl-C and SIGTERM leave nothing partial."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import sys
import tempfile
import traceback
import warnings

from ..core.errors import INTERRUPTED_EXIT, TERMINATED_EXIT, AttnResError, Interrupted, cli_words, first_line
from ..utils import outputs, progress
from . import env, parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; errors become one stderr line and their exit code (with --debug, also the
    traceback and the library log lines). Ctrl-C exits 130, SIGTERM 143, after cleaning up."""
    received = outputs.SIGNALS
    received.clear()
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    try:
        with _signals_as_exceptions(received, debug):
            code = _main(argv, received, debug)
            handled = len(received)
    except (KeyboardInterrupt, Interrupted) as exc:  # a signal after the command, while the handlers are restored
        return _interrupted(received, exc, debug)
    else:
        return _interrupted(received, None, debug) if len(received) > handled else code
    finally:
        received.clear()  # the command is over: later calls in this process may commit again


def _main(argv: list[str] | None, received: list[int], debug: bool) -> int:
    try:
        args = parser.build().parse_args(argv)
        with contextlib.nullcontext() if args.debug else _quiet():
            env.check()
            outputs.check(*args.outputs(args))
            with progress.on_terminal():
                code = args.run(args)
        if not received:
            return code
        raise KeyboardInterrupt  # a signal whose exception a library swallowed: still an interruption
    except BaseException as exc:  # noqa: BLE001 - never a bare traceback without --debug
        if isinstance(exc, SystemExit):  # argparse (--help, usage errors), after its one line
            raise
        if received or isinstance(exc, (KeyboardInterrupt, Interrupted)):
            return _interrupted(received, exc, debug)
        if isinstance(exc, AttnResError):  # one line even when a name from the model holds a newline
            return _fail(debug, cli_words(str(exc)), exc.exit_code)
        if not isinstance(exc, Exception):
            raise
        return _fail(debug, f"{first_line(exc)} (rerun with --debug for the traceback)", 1)


def _interrupted(received: list[int], exc: BaseException, debug: bool) -> int:
    """Exit 143 after SIGTERM, else 130 (Ctrl-C), with one line."""
    term = signal.SIGTERM in received or (isinstance(exc, Interrupted) and signal.SIGINT not in received)
    what, code = ("terminated (SIGTERM)", TERMINATED_EXIT) if term else ("interrupted (Ctrl-C)", INTERRUPTED_EXIT)
    return _fail(debug, f"{what}; no partial output was left", code)


def _fail(debug: bool, message: str, code: int) -> int:
    if debug:
        traceback.print_exc()
    line = f"attnres-compile: error: {' '.join(message.split())}\n"
    if _REAL_STDERR:  # a signal cut _quiet's restore short: fd 2 may still be its scratch file
        os.write(_REAL_STDERR[-1], line.encode())
    else:
        sys.stderr.write(line)
    return code


@contextlib.contextmanager
def _signals_as_exceptions(received: list[int], debug: bool):
    """The first Ctrl-C raises KeyboardInterrupt and SIGTERM Interrupted, so staging folders are removed;
    later ones are only recorded. All go to `received` (outputs.SIGNALS, which stops any commit),
    since an exception raised in a library callback can be swallowed."""
    armed = True

    def handler(signum, frame):
        first = not received
        received.append(signum)
        if first and armed:
            raise KeyboardInterrupt if signum == signal.SIGINT else Interrupted()

    def unraisable(report):
        if debug:
            previous_hook(report)

    try:
        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    previous_hook, sys.unraisablehook = sys.unraisablehook, unraisable
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # a caller may have blocked them
    try:
        yield
    finally:  # disarmed first: a signal while the handlers are put back is recorded (main reports it), not raised
        armed = False
        sys.unraisablehook = previous_hook
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # the caller's mask first: what it blocked waits for it
        for s, h in previous.items():
            signal.signal(s, h)


_REAL_STDERR: list[int] = []  # the terminal's stderr, duplicated, while _quiet has fd 2 on a scratch file


@contextlib.contextmanager
def _quiet():
    """Keep stderr to the one-line error: library warnings, log lines and partial graphs (Python's
    sys.stderr) and native libraries' lines written to file descriptor 2 (TVM, onnxruntime) go to
    a scratch file that is dropped; progress written to sys.__stderr__ stays visible."""
    import torch  # not for --help and usage errors

    torch._logging.set_logs(all=logging.CRITICAL)
    sys.stderr.flush()
    saved = os.dup(2)
    _REAL_STDERR.append(saved)
    scratch = tempfile.TemporaryFile()
    real_stderr = sys.__stderr__
    os.dup2(scratch.fileno(), 2)
    sys.__stderr__ = os.fdopen(os.dup(saved), "w", buffering=1)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        with contextlib.suppress(Exception):
            sys.__stderr__.close()
        sys.__stderr__ = real_stderr
        os.dup2(saved, 2)
        _REAL_STDERR.pop()
        os.close(saved)
        scratch.close()
        torch._logging.set_logs()  # back to torch's defaults

