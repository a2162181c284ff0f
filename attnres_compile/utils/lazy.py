"""PEP 562 module attributes: names a package exports from submodules it imports on first use."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def exports(package: str, homes: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """(__getattr__, __dir__) for `package`, whose name X lives in the module `homes[X]`, relative to
    the package (a submodule, or `..kernels.schedule` for a sibling package's); a name, once loaded,
    is stored on the package, so later lookups do not come back here."""

    def __getattr__(name: str):
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{homes[name]}", package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *homes})

    return __getattr__, __dir__
