"""torch.export's per-call input checks, with each input's checks read once instead of every call.

`install` puts `InputGuards` in front of the pre-hook `ExportedProgram.module()` installs (which
re-walks every input's fake shape through sympy per call): a call whose inputs plainly pass
(positional plain tensors, count, ranks, static dims, dynamic dims consistent and in range) is
accepted from facts read once per graph; anything else goes to torch's hook, so what passes and
the errors are torch's own.
"""

from __future__ import annotations

import math

import sympy
import torch
from torch import fx
from torch.export._unlift import _check_input_constraints_pre_hook
from torch.utils import _pytree as pytree


class InputGuards:
    """A forward pre-hook (with kwargs) in front of torch's `_check_input_constraints_pre_hook`; its
    checks are read on the first call after each `recompile()`. GraphModule's deepcopy drops forward
    pre-hooks, torch's too, so a copied module is checked by neither.
    """

    def __init__(self) -> None:
        self._code: str | None = None  # the module code the checks were read for
        self._checks: list[tuple] | None = None  # per input: ((static size | None, symbol, low, high), ...)

    def __deepcopy__(self, memo: dict) -> InputGuards:
        return InputGuards()

    def __call__(self, module: fx.GraphModule, args: tuple, kwargs: dict) -> None:
        if not module.validate_inputs:
            return
        if kwargs or torch.compiler.is_dynamo_compiling() or not self._accepts(module, args):
            _check_input_constraints_pre_hook(module, args, kwargs)  # torch decides, and raises its own errors

    def _accepts(self, module: fx.GraphModule, args: tuple) -> bool:
        if module._code is not self._code:
            self._checks, self._code = _read_checks(module), module._code
        checks = self._checks
        if checks is None or len(args) != len(checks):
            return False
        sizes: dict[sympy.Symbol, int] = {}
        for arg, dims in zip(args, checks):
            if type(arg) is not torch.Tensor:  # fake tensors, subclasses, non-tensors: torch's rules
                return False
            shape = arg.shape
            if len(shape) != len(dims):
                return False
            for size, (static, symbol, low, high) in zip(shape, dims):
                if symbol is None:
                    if size != static:
                        return False
                elif sizes.setdefault(symbol, size) != size or size < low or size > high:
                    return False
        return True


def _read_checks(module: fx.GraphModule) -> list[tuple] | None:
    """Per placeholder, its dims as (static size, None, 0, 0) or (None, symbol, low, high); None
    when a call cannot be judged this way (structured inputs, non-tensor placeholders, a dim that
    is an expression of symbols): then torch checks every call."""
    from torch._export.passes.add_runtime_assertions_for_constraints_pass import _convert_range_to_int
    from torch._subclasses.fake_tensor import FakeTensor

    spec = module._in_spec
    positional, named = spec.children() if spec.num_children == 2 else (None, None)
    if (positional is None or positional.type is not tuple or named.type is not dict or named.num_children
            or not all(c.is_leaf() for c in positional.children()) or torch.Tensor in pytree.SUPPORTED_NODES):
        return None
    placeholders = module.graph.find_nodes(op="placeholder")
    if len(placeholders) != positional.num_children:
        return None
    ranges = module.range_constraints
    checks = []
    for node in placeholders:
        val = node.meta.get("val")
        if not isinstance(val, FakeTensor):
            return None
        dims = []
        for size in val.shape:
            expr = size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)
            if expr.is_number:
                dims.append((int(expr), None, 0, 0))
            elif isinstance(expr, sympy.Symbol):
                low, high = _convert_range_to_int(ranges[expr]) if expr in ranges else (0, math.inf)
                dims.append((None, expr, low if low > 2 else 0, high))  # torch lets 0/1 (2) in below a minimum
            else:
                return None
        checks.append(tuple(dims))
    return checks


def install(gm: fx.GraphModule) -> fx.GraphModule:
    """Put `InputGuards` in place of torch.export's input-constraint pre-hook on `gm` (same slot,
    same order, `validate_inputs` still switches it). A no-op on a module without that hook
    (symbolic_trace, or already installed)."""
    for key, hook in gm._forward_pre_hooks.items():
        if hook is _check_input_constraints_pre_hook:
            gm._forward_pre_hooks[key] = InputGuards()
    return gm
