"""A user's `package.module:factory`: a callable returning (model, example_inputs), imported from the
working directory; every way it can fail is one InputError."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path

from ..core.errors import InputError, Interrupted, MemoryLimitError, first_line
from .isolate import MEMORY_ENV, out_of_memory

_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_ATTR = re.compile(r"^[A-Za-z_]\w*$")


def _factory_parts(spec: str) -> tuple[str, str]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not _MODULE.match(module_name) or not _ATTR.match(attr):
        raise InputError(f"model {spec!r} is neither an existing file nor of the form package.module:factory "
                         "(an importable module path and a function name)")
    return module_name, attr


def factory_file(spec: str) -> Path | None:
    """The source file of a factory's module, found without running the module (None if unknown)."""
    module_name, _ = _factory_parts(spec)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(module_name)
    except BaseException:  # noqa: BLE001 - a parent package that fails to import: load_factory reports it
        return None
    return Path(found.origin) if found is not None and found.origin and os.path.isfile(found.origin) else None


def load_factory(spec: str):
    """(model, example_inputs) from `package.module:factory`, importable from the working directory.

    Any failure of the module or the factory (an exception, a SyntaxError, sys.exit) is a bad
    factory (InputError); Ctrl-C and SIGTERM still interrupt."""
    module_name, attr = _factory_parts(spec)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (KeyboardInterrupt, Interrupted):
        raise
    except BaseException as exc:  # noqa: BLE001 - ImportError, SyntaxError, SystemExit, errors at import time
        raise InputError(f"cannot load factory {spec!r}: {_why(exc)}") from None
    if not callable(factory):
        raise InputError(f"factory {spec!r} is a {type(factory).__name__}, not a function")
    try:
        made = factory()
    except (KeyboardInterrupt, Interrupted):
        raise
    except BaseException as exc:  # noqa: BLE001
        if isinstance(exc, MemoryError) or out_of_memory(f"{type(exc).__name__}: {exc}"):
            raise MemoryLimitError(f"factory {spec!r} ran out of memory ({_why(exc)}); {MEMORY_ENV} sets the limit "
                                   "of the child processes that run it") from None
        raise InputError(f"factory {spec!r} raised {_why(exc)}") from None
    if not (isinstance(made, tuple) and len(made) == 2):
        raise InputError(f"factory {spec!r} must return (model, example_inputs), got {type(made).__name__}")
    return made


def _why(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"SystemExit: it called sys.exit({exc.code!r})"
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} ({Path(exc.filename or '?').name}, line {exc.lineno})"
    return first_line(exc)
