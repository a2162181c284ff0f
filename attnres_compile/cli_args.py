"""What the command line's arguments name, read the same by cli.py and the command modules it
registers (backends/tvm/cli.py, generate_cmd.py) without those importing cli.py: a number of
seconds, a size in bytes, a count, and a `package.module:factory` spec."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path

from .errors import InputError, Interrupted, first_line


def seconds(text: str) -> float:
    """A positive, finite number of seconds (an argparse type)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$")


def byte_size(text: str) -> int:
    """A positive number of bytes: 40GiB, 512 MiB, 1.5GB (decimal), 1e9 (an argparse type)."""
    match = _SIZE.match(text.lower())
    value = float(match.group(1)) * _UNITS[match.group(2)] if match and match.group(2) in _UNITS else 0
    if not 1 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a size such as 40GiB, 512MiB or 1.5GB, got {text!r}")
    return int(value)


def count(text: str) -> int:
    """A whole number of at least 1 (an argparse type)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


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
