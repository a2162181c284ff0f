"""torch.export's input checks, compiled once per GraphModule instead of re-derived every call.

`ExportedProgram.module()` installs a forward pre-hook (`_check_input_constraints_pre_hook`)
that, on every call, walks each placeholder's fake shape and checks the input against it
through sympy: `subs` and `try_solve` per dimension. On a decoder with a KV cache that is ~60
inputs × 4 dims per generated token: on SmolLM2-135M it was 3.1 of 5.8 s of HF `generate()`
through `generation.causal_lm`, more than the model. The checks themselves are cheap
integer comparisons once the placeholders are read, so `install` reads them once and replaces
the hook (through torch's own `validate_inputs` switch) with one that checks:

- the inputs' pytree structure against the exported spec (torch's `_check_inputs_match`);
- per tensor input: a tensor, its rank, each static dim equal, each dynamic dim unified across
  inputs (the same symbol, the same size) and inside its range (torch's rule: minimums of 0..2
  are not enforced, so size-0/1 inputs pass as they do in torch);
- anything else (a dim that is an expression of a symbol, an int/float/str or SymInt input)
  exactly as torch does, through its `_check_symint` / equality on that input.

The failures are torch's (same exception types and messages), so code that relies on them is
unchanged; only the per-call cost goes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx

_STATIC, _SYMBOL, _TORCH = 0, 1, 2  # how one dim is checked


@dataclass(frozen=True)
class _Dim:
    kind: int
    value: Any  # the int (static), the sympy Symbol (symbol), torch's SymInt (torch)
    low: int = 0  # enforced minimum (symbols only; 0 = none, as torch skips minimums <= 2)
    high: float = math.inf


@dataclass(frozen=True)
class _Input:
    node_val: Any  # a non-tensor placeholder's meta["val"] (checked torch's way); a tensor's shape, for messages
    dims: tuple[_Dim, ...] | None  # a tensor's dims; None for a non-tensor input


class InputGuards:
    """A forward pre-hook (with kwargs) equivalent to torch.export's input-constraint hook."""

    def __init__(self, gm: fx.GraphModule):
        from torch._export.passes.add_runtime_assertions_for_constraints_pass import _convert_range_to_int

        self.in_spec = gm._in_spec
        self.range_constraints = dict(gm.range_constraints)
        ranges = {s: _convert_range_to_int(r) for s, r in self.range_constraints.items()}
        self.inputs = [_input(node.meta.get("val"), ranges) for node in gm.graph.find_nodes(op="placeholder")]

    def __deepcopy__(self, memo: dict) -> InputGuards:
        return self  # read-only once built: a deep-copied GraphModule shares its guards

    def __call__(self, module: fx.GraphModule, args: tuple, kwargs: dict) -> None:
        from torch.export._unlift import _check_inputs_match

        flat = _check_inputs_match(args, kwargs, self.in_spec)
        if len(flat) != len(self.inputs):
            raise RuntimeError(f"Unexpected number of inputs (expected {len(self.inputs)}, got {len(flat)})")
        sizes: dict[sympy.Symbol, int] = {}
        for (path, arg), spec in zip(flat, self.inputs):
            if spec.dims is None:
                self._torch_check(spec.node_val, arg, path, None, sizes)
                continue
            if not isinstance(arg, torch.Tensor):
                raise RuntimeError(f"Expected input at {_path(path)} to be a tensor, but got {type(arg)}")
            shape = arg.shape
            if len(shape) != len(spec.dims):
                raise RuntimeError(f"Unexpected number of dimensions in input at {_path(path)}.shape "
                                   f"(expected {spec.node_val}, got {shape})")
            for i, (size, dim) in enumerate(zip(shape, spec.dims)):
                if dim.kind == _STATIC:
                    if size != dim.value:
                        raise RuntimeError(
                            f"Expected input at {_path(path)}.shape[{i}] to be equal to {dim.value}, but got {size}. "
                            "If you meant for this dimension to be dynamic, please re-export and specify "
                            "dynamic_shapes (e.g. with Dim.DYNAMIC)")
                elif dim.kind == _SYMBOL:
                    seen = sizes.setdefault(dim.value, size)
                    if seen != size:
                        raise RuntimeError(f"Expected input at {_path(path)}.shape[{i}] to be equal to {seen}, but got {size}")
                    if size < dim.low:
                        raise RuntimeError(f"Expected input at {_path(path)}.shape[{i}] to be >= {dim.low}, but got {size}")
                    if size > dim.high:
                        raise RuntimeError(f"Expected input at {_path(path)}.shape[{i}] to be <= {dim.high}, but got {size}")
                else:
                    self._torch_check(dim.value, size, path, i, sizes)

    def _torch_check(self, node_val: Any, arg: Any, path, i: int | None, sizes: dict) -> None:
        """torch's own check of one input or dim (sympy), for what `install` did not compile."""
        from torch._export.utils import _check_input_constraints_for_graph, _check_symint

        if isinstance(node_val, torch.SymInt):
            _check_symint(node_val, arg, self.range_constraints, sizes, path, i)
        else:  # int/float/str placeholders (and none): torch's equality rules
            _check_input_constraints_for_graph([_Placeholder(node_val)], [(path, arg)], self.range_constraints)


class _Placeholder:
    """What torch's graph check reads of a placeholder node: its meta."""

    def __init__(self, val: Any):
        self.meta = {"val": val}


def _input(val: Any, ranges: dict) -> _Input:
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(val, FakeTensor):
        return _Input(val, None)
    return _Input(val.shape, tuple(_dim(d, ranges) for d in val.shape))


def _dim(size: Any, ranges: dict) -> _Dim:
    if not isinstance(size, torch.SymInt):
        return _Dim(_STATIC, int(size))
    expr = size.node.expr
    if expr.is_number:
        return _Dim(_STATIC, int(expr))
    if isinstance(expr, sympy.Symbol):
        low, high = ranges.get(expr, (0, math.inf))
        return _Dim(_SYMBOL, expr, low if low > 2 else 0, high)
    return _Dim(_TORCH, size)


def _path(path) -> str:
    from torch._export.utils import get_keystr

    return get_keystr(path)


def install(gm: fx.GraphModule) -> fx.GraphModule:
    """Check `gm`'s inputs with compiled guards instead of torch.export's per-call sympy hook.

    A no-op on a GraphModule that has no such hook (symbolic_trace, or already installed).
    """
    if not getattr(gm, "validate_inputs", False) or not hasattr(gm, "_in_spec") or not hasattr(gm, "range_constraints"):
        return gm
    gm.register_forward_pre_hook(InputGuards(gm), with_kwargs=True)
    gm.validate_inputs = False  # torch's switch for its own hook (torch/export/_unlift.py)
    return gm
