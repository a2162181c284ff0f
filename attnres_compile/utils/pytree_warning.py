"""torch 2.13 warns "`isinstance(treespec, LeafSpec)` is deprecated" (a FutureWarning raised in
copyreg) whenever it deep-copies a pytree spec, as in copying a GraphModule or updating an
ExportedProgram. The caller can do nothing about it: our copies silence that one message."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from typing import TypeVar

MESSAGE = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
_T = TypeVar("_T")


@contextlib.contextmanager
def silenced() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=MESSAGE, category=FutureWarning)
        yield


def deepcopy(obj: _T) -> _T:
    """copy.deepcopy(obj) without torch's LeafSpec deprecation warning."""
    with silenced():
        return copy.deepcopy(obj)
