"""onnxscript's optimizer with our rule set (`our_rules`): its no-op rules made exact, its
Slice pair rule left out.
onnxscript drops `x + c`, `x - c`, `x * c`, `x / c` where c is merely close to 0 or 1, which
removes an RMSNorm's `+ 1e-8` and turns a zero row into NaN: here those rules match only an
exact 0 or 1. SlicesSplit (two Slices of one input as a Split) is a two-output pattern that
onnxscript's matcher tries from every node: 32 of 36 s of rule time on a 30-layer decoder, for a
Split in place of rotate_half's two Slices.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import onnx_ir as ir
from onnxscript import rewriter
from onnxscript.rewriter import pattern
from onnxscript.rewriter.rules.common import _basic_rules, _no_op

# onnxscript's tolerant rules (the `x + 0` and `x * 1` rules with their commuted forms)
TOLERANT = tuple(r for r in _no_op.rules.rules if r not in (_no_op.dropout_zero_rule, _no_op.dropout_inference_rule))


def _scalar_is(value: ir.Value, expected: float) -> bool:
    """Whether `value` is a constant rank-0 tensor equal to `expected` (no tolerance)."""
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None or tensor.shape.rank() != 0:
        return False
    return tensor.numpy().item() == expected


def _rule(op_name: str, neutral: float, commute: bool) -> list[pattern.RewriteRule]:
    def target(op, x, c):
        return getattr(op, op_name)(x, c)

    def replacement(op, x, c):
        return op.Identity(x)

    def check(context, x, c, **_) -> bool:
        return _scalar_is(c, neutral)

    rule = pattern.RewriteRule(target, replacement, check)
    return rule.commute() if commute else [rule]


EXACT = (*_rule("Add", 0.0, True), *_rule("Sub", 0.0, False), *_rule("Mul", 1.0, True), *_rule("Div", 1.0, False))


@contextlib.contextmanager
def our_rules() -> Iterator[None]:
    """onnxscript's default rewrite rules, its tolerant no-op rules replaced by EXACT and SlicesSplit
    left out, while inside."""
    left_out = (*TOLERANT, _basic_rules.slice_split_rule)
    rules = tuple(r for r in rewriter._DEFAULT_REWRITE_RULES if r not in left_out)
    with mock.patch.object(rewriter, "_DEFAULT_REWRITE_RULES", (*rules, *EXACT)):
        yield
