"""fx/lean.py: the copy of a rewritten decoder that generation.causal_lm runs each step.

It must compute what the graph module computes (bit for bit: it only drops dead nodes, checks and
same-dtype casts), with fewer operator calls and no deep attribute chains; read parameters that
are updated or reassigned after it was built; and step aside (`fits` False) where the dropped
checks would not pass, so the graph module's own checks decide.
"""

from __future__ import annotations

import pytest
import torch

import attnres_compile as ac
from attnres_compile.fx import decoder
from attnres_compile.generation import serve as generation
from attnres_compile.fx import lean as fx_lean
from samples.hf_decoders import DECODERS

aten = torch.ops.aten


@pytest.fixture(scope="module")
def llama():
    model, example = DECODERS["llama"]()
    result = ac.rewrite(model, example, ac.AttnResConfig(variant="block", num_blocks=2), with_past=True,
                        verify_outputs=False)
    return model, example, result.graph_module


def _calls(gm, target=None):
    return [n for n in gm.graph.nodes if n.op == "call_function" and (target is None or n.target is target)]


def _step_args(model, example, gm):
    """(prefill args, decode-step args) of the decoder with past: 9 tokens, then the 10th."""
    ids, mask = example["input_ids"][:, :10], example["attention_mask"][:, :10]
    geometry = decoder.probe(model, torch.zeros(1, 2, dtype=torch.long))[0]
    first = (ids[:, :9], mask[:, :9], decoder.positions(mask[:, :9], 9), *geometry.empty_past(2))
    with torch.no_grad():
        out = gm(*first)
    past = [out[n] for n in geometry.output_names()[1:]]
    return first, (ids[:, 9:], mask, decoder.positions(mask, 1), *past)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lean_copy_is_the_graph_with_fewer_calls(llama):
    model, example, gm = llama
    lean = fx_lean.lean_copy(gm)
    assert lean is not None
    before, after = len(_calls(gm)), len(_calls(lean.module))
    assert after < 0.85 * before, (before, after)  # 2 layers: the empty-cache chains, asserts and casts
    assert not _calls(lean.module, aten.lift_fresh_copy.default)
    assert all(n.args[0].op != "call_function" for n in _calls(lean.module, aten._assert_tensor_metadata.default))
    assert all(n.target.count(".") == 1 for n in lean.module.graph.find_nodes(op="get_attr"))  # one hop each
    assert "getattr(" not in lean.module.code
    with torch.no_grad():
        for args in _step_args(model, example, gm):
            assert lean.fits(args)
            assert _equal(lean.module(*args), gm(*args))


def test_lean_copy_reads_parameters_changed_after_it_was_built(llama):
    model, example, gm = llama
    lean = fx_lean.lean_copy(gm)
    args = _step_args(model, example, gm)[1]
    layer = gm.get_submodule("model.model.layers.1.mlp.up_proj")
    query = next(n for n, _ in gm.named_parameters() if n.startswith("attnres"))
    saved = (layer.weight, gm.get_parameter(query).detach().clone())
    with torch.no_grad():
        before = gm(*args)
    try:
        with torch.no_grad():
            gm.get_parameter(query).add_(0.5)  # in place (an optimizer step)
        layer.weight = torch.nn.Parameter(saved[0].detach() * 2)  # reassigned (load_state_dict(assign=True))
        with torch.no_grad():
            changed = gm(*args)
            assert not torch.equal(changed["logits"], before["logits"])
            assert lean.fits(args) and _equal(lean.module(*args), changed)
    finally:
        layer.weight = saved[0]
        with torch.no_grad():
            gm.get_parameter(query).copy_(saved[1])


def test_lean_copy_steps_aside_where_the_dropped_checks_would_fail(llama):
    model, example, gm = llama
    lean = fx_lean.lean_copy(gm)
    first, step = _step_args(model, example, gm)
    assert not lean.fits((*step[:3], *(t.double() for t in step[3:])))  # a float64 cache
    assert not lean.fits(step[:-1])
    norm = gm.get_submodule("model.model.norm")
    weight = norm.weight
    try:
        norm.weight = torch.nn.Parameter(weight.detach().double())
        assert not lean.fits(step)
    finally:
        norm.weight = weight
    assert lean.fits(step)


def test_causal_lm_steps_run_the_lean_copy(llama, monkeypatch):
    model, example, gm = llama
    lm = generation.causal_lm(model, gm)
    ran, pick = [], fx_lean.Lean.pick
    monkeypatch.setattr(fx_lean.Lean, "pick", lambda self, args: ran.append((self, pick(self, args))) or ran[-1][1])
    prompt = example["input_ids"][:, :6]
    got = lm.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    assert torch.equal(got, expected)
    prefill, steps = lm._attnres_lean[1][True], lm._attnres_lean[1][False]
    assert [lean for lean, _ in ran] == [prefill, steps, steps, steps]
    assert all(module is lean.inference is not None for lean, module in ran)  # generate() runs under no_grad
    assert prefill.module.graph.find_nodes(op="call_function", target=aten.slice.Tensor)  # the last position only


def test_a_graph_that_calls_submodules_gets_no_lean_copy():
    """symbolic_trace graphs call submodules: no copy (None), so callers run the graph itself,
    rather than fx's purity check failing. `ExportedProgram.module()` calls one, torch's
    `_guards_fn`: its copy keeps that call, and its guards still fail where they fail."""
    traced = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    assert fx_lean.lean_copy(traced) is None
    x = torch.randn(2, 4)
    program = torch.export.export(torch.nn.Linear(4, 4), (x,)).module()  # static shapes: guards on both dims
    lean = fx_lean.lean_copy(program)
    assert lean is not None and lean.module.graph.find_nodes(op="call_module", target="_guards_fn")
    assert lean.fits((x,)) and torch.equal(lean.module(x), program(x))
    with pytest.raises(AssertionError, match="Guard failed"):
        lean.module(torch.randn(3, 4))


def test_lean_copy_of_a_loaded_program_checks_its_inputs_once_per_graph(monkeypatch):
    """On `ExportedProgram.module()`'s copy, torch's pre-hook (its pytree structure check, ~60 us a
    decode step) is behind InputGuards, whose checks are read once per graph: a call with the
    traced ranks and dims does not reach torch's hook, a changed dynamic dim still passes, and a
    wrong static dim still fails (torch's hook decides, then the graph)."""
    from torch.export import Dim

    x = torch.randn(2, 4)
    program = torch.export.export(torch.nn.Linear(4, 4), (x,), dynamic_shapes=({0: Dim("batch")},)).module()
    lean = fx_lean.lean_copy(program)
    hooks = list(lean.module._forward_pre_hooks.values())
    assert any(isinstance(h, fx_lean.input_guards.InputGuards) for h in hooks)
    reached, torch_hook = [], fx_lean.input_guards._check_input_constraints_pre_hook
    monkeypatch.setattr(fx_lean.input_guards, "_check_input_constraints_pre_hook",
                        lambda *a: reached.append(1) or torch_hook(*a))
    read = []
    monkeypatch.setattr(fx_lean.input_guards, "_read_checks",
                        lambda m, real=fx_lean.input_guards._read_checks: read.append(1) or real(m))
    for batch in (2, 5, 3):
        xb = torch.randn(batch, 4)
        assert torch.equal(lean.module(xb), program(xb))
    assert (reached, read) == ([], [1])
    with pytest.raises(Exception):
        lean.module(torch.randn(2, 5))
    assert reached == [1]


def test_lean_copy_keeps_the_modules_forward_pre_hooks(llama):
    """The input checks (InputGuards here; torch's own hook on a module that kept it) and any other
    pre-hook run on the copy as on the graph module."""
    model, example, gm = llama
    seen = []
    handle = gm.register_forward_pre_hook(lambda module, args: seen.append(len(args)))
    try:
        lean = fx_lean.lean_copy(gm)
    finally:
        handle.remove()
    kinds = [type(h) for h in lean.module._forward_pre_hooks.values()]
    assert fx_lean.input_guards.InputGuards in kinds and len(kinds) == len(gm._forward_pre_hooks) + 1
    with torch.no_grad():
        lean.module(*_step_args(model, example, gm)[1])
    assert seen == [len(_step_args(model, example, gm)[1])]


def test_inference_copy_calls_the_kernel_without_per_site_checks(llama, monkeypatch):
    """Under no_grad with nothing watching the op, `pick` gives `inference`, whose sites call the
    op's kernel with no per-site shortcut checks (the graph module and `module` make them at
    every site: 24 a step at Block 256/24); the same values bit for bit. With grad mode on, under
    a dispatch mode or the profiler, `module` runs, as the op's own sites would decide."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from attnres_compile.ops import depth_attention as op

    model, example, gm = llama
    lean = fx_lean.lean_copy(gm)
    step = _step_args(model, example, gm)[1]
    sites = len(_calls(gm, op.depth_attention))
    assert sites and not _calls(lean.inference, op.depth_attention)
    assert len(_calls(lean.inference, op.direct_forward)) == sites
    checks, kernel = [], []
    monkeypatch.setattr(op, "_shortcut", lambda *a, real=op._shortcut: checks.append(1) or real(*a))
    with op.observe(lambda *a: kernel.append(1)), torch.no_grad():
        assert lean.pick(step) is lean.inference
        got = lean.inference(*step)
        assert (len(checks), len(kernel)) == (0, sites)
        assert _equal(got, gm(*step)) and len(checks) == sites
    with torch.enable_grad():
        assert lean.pick(step) is lean.module
    with torch.no_grad(), TorchDispatchMode():
        assert lean.pick(step) is lean.module
    with torch.no_grad(), torch.profiler.profile():
        assert lean.pick(step) is lean.module
    assert lean.pick(step[:-1]) is None


def test_lean_copy_reads_grouped_query_keys_and_values_unrepeated(llama):
    """Llama here has 2 query heads on 1 KV head: its trace copies the cache per query head
    (repeat_kv: unsqueeze, expand, reshape) into every SDPA; the copy reads K and V as they are
    with enable_gqa=True, bit for bit the same, prefill and step. Multi-head GPT-2 keeps its SDPA."""
    model, example, gm = llama
    lean = fx_lean.lean_copy(gm)
    sdpa = _calls(lean.module, aten.scaled_dot_product_attention.default)
    assert sdpa and all(n.kwargs.get("enable_gqa") for n in sdpa)
    assert all(n.args[i].meta["val"].shape[1] == 1 for n in sdpa for i in (1, 2))  # the KV heads, unrepeated
    assert not any(n.kwargs.get("enable_gqa") for n in _calls(gm, aten.scaled_dot_product_attention.default))
    with torch.no_grad():
        for args in _step_args(model, example, gm):
            assert _equal(gm(*args), lean.module(*args)) and _equal(gm(*args), lean.inference(*args))
    gpt, gpt_example = DECODERS["gpt2"]()
    traced = ac.rewrite(gpt, gpt_example, ac.AttnResConfig(variant="block", num_blocks=2), with_past=True,
                        verify_outputs=False).graph_module
    sdpa = _calls(fx_lean.lean_copy(traced).module, aten.scaled_dot_product_attention.default)
    assert sdpa and not any(n.kwargs.get("enable_gqa") for n in sdpa)
