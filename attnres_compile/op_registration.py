"""Registers torch.ops.attnres.* (op.py, op_two_phase.py) when torch is imported, not before:
importing the package then costs no torch (~1.2 s of CPU, which `attnres-compile --help` no
longer pays), and `import attnres_compile` still lets torch.export.load read a saved program,
whichever of the two a caller imports first.

The hook is an import-system finder that finds nothing itself: for `torch` and for `op` it takes
the spec the other finders give and, once that module has run, imports the next one (torch ->
op -> op_two_phase -> op_site_norm). op_two_phase and op_site_norm read names from op, so they wait
for op to finish, also when op is the module that first imported torch."""

from __future__ import annotations

import importlib
import importlib.abc
import sys

_OP = f"{__package__}.op"
_TWO_PHASE = f"{__package__}.op_two_phase"
_SITE_NORM = f"{__package__}.op_site_norm"


def register_ops() -> None:
    """Import the op modules now if torch is loaded, else as soon as it is."""
    if "torch" in sys.modules:
        importlib.import_module(_TWO_PHASE)
        importlib.import_module(_SITE_NORM)
    else:
        sys.meta_path.insert(0, _AfterImport({"torch": _OP, _OP: _TWO_PHASE, _TWO_PHASE: _SITE_NORM}))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Imports `then[name]` right after module `name` has run; leaves sys.meta_path when all have.
    A look-up without an import (importlib.util.find_spec("torch"), as transformers does) only
    wraps a loader that never runs."""

    def __init__(self, then: dict[str, str]):
        self.then = then

    def find_spec(self, name, path=None, target=None):
        if name not in self.then:
            return None
        spec = next((s for f in list(sys.meta_path) if f is not self and hasattr(f, "find_spec")
                     for s in [f.find_spec(name, path, target)] if s is not None), None)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            follow = self.then.pop(name, None)
            if not self.then and self in sys.meta_path:
                sys.meta_path.remove(self)
            if follow:
                importlib.import_module(follow)

        spec.loader.exec_module = exec_module
        return spec
