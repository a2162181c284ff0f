"""fx/input_guards.py: torch.export's input checks without sympy on every call, same verdicts.

api.trace puts `InputGuards` in front of torch's `_check_input_constraints_pre_hook`. Each call
here runs the traced module twice, once with our hook and once with torch's hook put back in the
same slot, and the outcomes (ok, or the exception's type and message) must be the same: wrong
rank, static dim, batch across inputs, past lengths, range, derived dims, type, count, kwargs
and dtype.
On plain calls torch's hook (sympy) must not run at all.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.export import Dim
from torch.export._unlift import _check_input_constraints_pre_hook

from attnres_compile.generation.serve import decoder
from attnres_compile.fx.trace import trace
from attnres_compile.fx import input_guards
from samples.hf_decoders import llama_factory


@pytest.fixture(scope="module")
def traced():
    model, example = llama_factory()
    wrapper, args, spec = decoder.wrap(model, example)
    return trace(wrapper, args, spec).graph_module, args


def _slot(gm) -> int:
    return next(k for k, h in gm._forward_pre_hooks.items() if isinstance(h, input_guards.InputGuards))


def _outcome(gm, args, kwargs=None) -> str:
    try:
        with torch.no_grad():
            gm(*args, **(kwargs or {}))
        return "ok"
    except Exception as exc:  # noqa: BLE001 - the outcome compared is the exception itself
        return f"{type(exc).__name__}: {exc}"


def _both(gm, args, kwargs=None) -> tuple[str, str]:
    """(outcome with InputGuards, outcome with torch's own hook in its place)."""
    slot = _slot(gm)
    ours = _outcome(gm, args, kwargs)
    hook, gm._forward_pre_hooks[slot] = gm._forward_pre_hooks[slot], _check_input_constraints_pre_hook
    try:
        return ours, _outcome(gm, args, kwargs)
    finally:
        gm._forward_pre_hooks[slot] = hook


def _calls(monkeypatch) -> list:
    seen = []
    monkeypatch.setattr(input_guards, "_check_input_constraints_pre_hook",
                        lambda *a: seen.append(1) or _check_input_constraints_pre_hook(*a))
    return seen


def test_decoder_inputs_fail_as_torch_fails_them(traced, monkeypatch):
    gm, args = traced
    ids, mask, pos, *past = args
    step = (ids[:, :1], torch.ones(2, 8, dtype=torch.long), pos[:, :1], *(p[:, :, :7] for p in past))
    grown = [torch.cat([p, p[:, :, :1]], 2) for p in past]
    cases = {
        "decode step": step,
        "prefill (past 0)": (ids, mask, pos, *(p[:, :, :0] for p in past)),
        "batch 1": tuple(t[:1] for t in step),
        "past lengths differ": (*step[:3], *past[:-1], grown[-1]),
        "batch differs": (*step[:3], *past[:-1], past[-1][:1]),
        "head count": (*step[:3], *past[:-1], torch.cat([past[-1]] * 2, 1)),
        "head dim": (*step[:3], *past[:-1], past[-1][..., :8]),
        "rank": (*step[:3], *past[:-1], past[-1][0]),
        "not a tensor": (*step[:3], *past[:-1], 3),
        "one input short": step[:-1],
        "float ids": (step[0].float(), *step[1:]),
        "int32 mask": (step[0], step[1].int(), *step[2:]),
    }
    seen = _calls(monkeypatch)
    outcomes = {name: _both(gm, case) for name, case in cases.items()}
    for name, (ours, torchs) in outcomes.items():
        assert ours == torchs, name
    assert outcomes["decode step"][0] == outcomes["prefill (past 0)"][0] == outcomes["batch 1"][0] == "ok"
    assert "to be equal to 2, but got 1" in outcomes["batch differs"][0]
    assert "shape[1] to be equal to 1, but got 2" in outcomes["head count"][0]
    assert "Unexpected number of dimensions" in outcomes["rank"][0]
    assert "to be a tensor" in outcomes["not a tensor"][0]
    assert outcomes["one input short"][0].startswith("ValueError: Trying to flatten user inputs")
    assert outcomes["float ids"][0] != "ok" and outcomes["int32 mask"][0] != "ok"  # dtypes: the graph's own asserts
    seen.clear()
    kw = _both(gm, step[:-1], {"past_3": step[-1]})  # by name: torch's path, torch's verdict
    assert kw[0] == kw[1] and seen == [1]
    seen.clear()
    for _ in range(3):
        _outcome(gm, step)
    assert seen == []  # plain calls: no sympy, no torch hook


def test_ranges_and_derived_dims_as_torch():
    class Pair(torch.nn.Module):
        def forward(self, x, y):
            return x.sum() + y.sum()

    batch = Dim("batch", min=3, max=8)
    gm = trace(Pair(), (torch.ones(4, 2), torch.ones(4, 3)), ({0: batch}, {0: batch})).graph_module
    for rows in ((2, 2), (3, 3), (8, 8), (9, 9), (4, 5)):
        ours, torchs = _both(gm, (torch.ones(rows[0], 2), torch.ones(rows[1], 3)))
        assert ours == torchs, rows
    assert _both(gm, (torch.ones(9, 2), torch.ones(9, 3)))[0].endswith("to be <= 8, but got 9")

    n = Dim("n", min=2, max=16)
    derived = trace(Pair(), (torch.ones(4), torch.ones(5)), ({0: n}, {0: n + 1})).graph_module
    for sizes in ((4, 5), (6, 7), (6, 6)):
        ours, torchs = _both(derived, (torch.ones(sizes[0]), torch.ones(sizes[1])))
        assert ours == torchs, sizes
    assert _both(derived, (torch.ones(6), torch.ones(6)))[0] != "ok"


def test_reexport_switch_and_copies(traced, monkeypatch):
    gm, args = traced
    # export runs the hook on fake inputs: nothing may specialise (torch's hook skips symbolic dims)
    dyn = Dim.DYNAMIC
    spec = ({0: dyn, 1: dyn}, {0: dyn, 1: dyn}, {0: dyn, 1: dyn}, *({0: dyn, 2: dyn} for _ in args[3:]))
    again = torch.export.export(gm, args, dynamic_shapes=spec, strict=False)
    assert len(again.range_constraints) == len(gm.range_constraints) > 0
    seen = _calls(monkeypatch)
    gm.validate_inputs = False  # torch's switch still turns the checks off
    try:
        assert _outcome(gm, (*args[:3], *args[3:-1], args[-1][..., :8])) != "ok"  # fails in the graph, not a guard
        assert seen == []
    finally:
        gm.validate_inputs = True
    twin = copy.deepcopy(gm)  # GraphModule's deepcopy drops pre-hooks, torch's as ours
    assert not any(isinstance(h, input_guards.InputGuards) for h in twin._forward_pre_hooks.values())
    assert copy.deepcopy(input_guards.InputGuards())._checks is None
