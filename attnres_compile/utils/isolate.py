"""Run what executes a user's graph (onnxruntime sessions, TVM import and build) in a forked child
with time and memory limits, so a native crash, an endless loop or a memory blow-up becomes one
error line (exit 16 crash, 17 time limit, 18 memory limit) instead of killing or hanging us.

The child runs one function, pickles its result back, never returns into the caller's code and
dies with its parent. Its output reaches our stderr afterwards (shown with --debug); RLIMIT_AS is
its size at the fork plus `memory_budget`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import select
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from ..core.errors import AttnResError, CrashError, MemoryLimitError, TimeLimitError, first_line

MEMORY_ENV = "ATTNRES_COMPILE_MEMORY_LIMIT"
MAX_MEMORY = 1 << 60  # 1 EiB: beyond any address space, and the child's limit (its size plus this) fits RLIMIT_AS
_OOM_WORDS = re.compile(r"bad_alloc|Failed to allocate|out of memory|MemoryError|Cannot allocate memory",
                        re.IGNORECASE)


def out_of_memory(message: str) -> bool:
    """Whether an error message says that memory ran out (bad_alloc, "Failed to allocate", ...)."""
    return bool(_OOM_WORDS.search(message))


def memory_budget() -> int:
    """Bytes the child may add to its size at the fork: $ATTNRES_COMPILE_MEMORY_LIMIT (e.g. 4G,
    512M, or bytes; 1 byte to 1 EiB, else ConfigError), else 80% of the memory available now
    (MemAvailable, or the cgroup's room)."""
    given = os.environ.get(MEMORY_ENV, "").strip()
    if given:
        from ..core.errors import ConfigError

        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?", given, re.IGNORECASE)
        if m is None:
            raise ConfigError(f"{MEMORY_ENV}={given!r} is not a size such as 4G or 512M")
        size = int(float(m[1]) * 1024 ** " KMGT".index(m[2].upper() or " "))
        if not 1 <= size <= MAX_MEMORY:
            raise ConfigError(f"{MEMORY_ENV}={given!r} is {'less than a byte' if size < 1 else 'more than 1 EiB'}: "
                              "give a size such as 4G (the limit cannot be turned off; 1000T lifts it in practice)")
        return size
    available = _meminfo("MemAvailable") or 8 << 30
    room = _cgroup_room()
    return int(0.8 * min(available, room) if room else 0.8 * available)


def _meminfo(key: str) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    return None


def _cgroup_room() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        if limit != "max":
            return max(0, int(limit) - int(open("/sys/fs/cgroup/memory.current").read()))
    return None


def _vm_size() -> int:
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    return 0


def run(fn: Callable[..., Any], *args: Any, what: str, action: str, timeout: float | None,
        memory: int | None = None, consequence: str = "", hint: str = "", cpu: float | None = None,
        **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` in a forked child; its result. `what`, `action`, `consequence` and `hint`
    make up the error line. AttnResErrors are re-raised; a signal -> CrashError; over `timeout` wall
    or `cpu` CPU seconds -> TimeLimitError; memory -> MemoryLimitError.
    """
    budget = memory_budget() if memory is None else memory
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    read_end, write_end = os.pipe()
    log = tempfile.TemporaryFile()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_end)
        _die_with(parent)
        _child(fn, args, kwargs, write_end, log.fileno(), budget, cpu)
    os.close(write_end)
    start = time.monotonic()
    chunks: list[bytes] = []
    status = None
    try:
        while True:
            left = float("inf") if timeout is None else timeout - (time.monotonic() - start)
            if left <= 0:
                break
            ready, _, _ = select.select([read_end], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(read_end, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        timed_out = timeout is not None and time.monotonic() - start >= timeout
        if timed_out:
            os.kill(pid, signal.SIGKILL)
        _, status, usage = os.wait4(pid, 0)
    finally:
        os.close(read_end)
        if status is None:  # interrupted (Ctrl-C, SIGTERM) or an error here: the child goes too
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        noise = _replay(log)
    lead = f"{what} {{}} while {action}" + (f"; {consequence}" if consequence else "")
    tail = f". {hint}" if hint else ""
    if timed_out:
        raise TimeLimitError(lead.format(f"did not finish within {timeout:.0f} s") + tail)
    if cpu is not None and usage.ru_utime + usage.ru_stime >= cpu:
        raise TimeLimitError(lead.format(f"used more than {cpu:.0f} s of CPU time") + tail)
    data = b"".join(chunks)
    if os.WIFSIGNALED(status) or not data:
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        name = signal.Signals(sig).name if sig else f"exit status {os.WEXITSTATUS(status)}"
        if _OOM_WORDS.search(noise) or sig == signal.SIGKILL:
            raise MemoryLimitError(lead.format(f"ran out of memory ({name}, limit {budget / 2**30:.1f} GiB more "
                                               f"than at the start; {MEMORY_ENV} sets it)") + tail)
        raise CrashError(lead.format(f"crashed ({name})") + tail)
    kind, value = pickle.loads(data)
    if kind == "ok":
        return value
    if kind == "attnres":
        raise value
    message, out_of_memory = value
    if out_of_memory:
        raise MemoryLimitError(lead.format(f"ran out of memory ({message}; limit {budget / 2**30:.1f} GiB, "
                                           f"{MEMORY_ENV} sets it)") + tail)
    raise ChildError(lead.format(f"failed ({message})") + tail)


class ChildError(AttnResError):
    """The function raised an exception that is not an AttnResError (its first line is kept);
    callers turn it into their own error class (onnxruntime refusing a model: ModelRunError)."""


def _child(fn, args, kwargs, out_fd: int, log_fd: int, budget: int, cpu: float | None) -> None:
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        sys.stdout = sys.stderr = open(log_fd, "w", closefd=False)
        _limit_memory(budget)
        _limit_cpu(cpu)
        with contextlib.suppress(Exception):
            import torch

            torch.set_num_threads(1)  # the parent's OpenMP pool does not survive a fork
        try:
            result = ("ok", fn(*args, **kwargs))
        except AttnResError as exc:
            result = ("attnres", exc)
        except BaseException as exc:  # noqa: BLE001 - reported by the parent in one line
            traceback.print_exc()
            result = ("error", (first_line(exc), bool(_OOM_WORDS.search(f"{type(exc).__name__}: {exc}"))))
        try:
            data = pickle.dumps(result)
        except Exception as exc:  # noqa: BLE001
            data = pickle.dumps(("error", (f"its result cannot be sent back ({first_line(exc)})", False)))
        view = memoryview(data)
        while view:
            view = view[os.write(out_fd, view):]
    except BaseException:  # noqa: BLE001
        with contextlib.suppress(Exception):
            traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(code)


def _die_with(parent: int) -> None:
    """SIGKILL this child when its parent dies (even by kill -9), so that no endless loop outlives it."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _limit_memory(budget: int) -> None:
    import resource

    if budget <= 0:
        return
    limit = _vm_size() + budget
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _limit_cpu(seconds: float | None) -> None:
    """SIGXCPU (then SIGKILL) past `seconds` of CPU time, without a core file."""
    import math
    import resource

    if seconds is None:
        return
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    ceiling = math.inf if hard == resource.RLIM_INFINITY else hard
    soft = int(min(max(1, math.ceil(seconds)), ceiling))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (soft, int(min(soft + 2, ceiling))))
    signal.signal(signal.SIGXCPU, signal.SIG_DFL)


def _replay(log) -> str:
    """The child's collected output, written to our stderr (hidden by the CLI unless --debug)."""
    try:
        log.seek(0)
        text = log.read().decode("utf-8", "replace")
        log.close()
    except OSError:
        return ""
    if text:
        with contextlib.suppress(Exception):
            sys.stderr.write(text)
            sys.stderr.flush()
    return text
