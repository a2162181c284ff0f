"""The two-phase ops (depth_attention_partial, depth_attention_merge) against the one-pass op, with
both implementations (fused TVM kernels and the eager reference), and the fx pass that puts them
into rewritten HF models (`two_phase`): trace, rewrite, pass, graph.lint(), compare outputs and
gradients with the one-pass graph."""

import collections
import copy
import io

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import attnres_compile as ac
from attnres_compile.ops import depth_attention as op_module
from attnres_compile.kernels import cache as kernel_cache
from attnres_compile.kernels import fused
from attnres_compile.ops.two_phase import depth_attention_merge as merge
from attnres_compile.ops.two_phase import depth_attention_partial as partial
from samples import hf_models

op = torch.ops.attnres.depth_attention.default


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape,dim", [((2, 7, 32), -1), ((2, 8, 3, 3), 1)])
def test_partial_then_merge_is_the_site(kernel, dtype, shape, dim):
    """Every query of a partial over 5 sources, merged with 1 or 3 extras, equals the one-pass op
    over all of them: to float32 reassociation (1e-6 of the output's scale), and for bfloat16
    storage to the output's own rounding."""
    g = torch.Generator().manual_seed(0)
    history = [(torch.randn(*shape, generator=g) * (i + 1)).to(dtype) for i in range(5)]
    extra = [torch.randn(*shape, generator=g).to(dtype) for _ in range(3)]
    queries = torch.randn(4, shape[dim], generator=g)
    m, l, acc = partial(history, queries, 1e-6, dim)
    assert m.dtype == acc.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = 1e-6 if dtype != torch.bfloat16 else torch.finfo(dtype).eps
    for q in range(4):
        for e in (1, 3):
            out = merge(m, l, acc, q, extra[:e], queries[q], 1e-6, float(5 + e), dim)
            ref = op(history + extra[:e], queries[q], 1e-6, float(5 + e), dim)
            assert out.dtype == dtype and out.shape == ref.shape
            assert _rel(out, ref) <= tol, (q, e)


def test_fused_pair_runs_where_it_applies(monkeypatch):
    """float32 [.., D] CPU sources take the fused pair; a failure to call it would fall back silently,
    so the fused entry points are checked directly, and mode eager never reaches them."""
    x = [torch.randn(3, 4, 16) for _ in range(4)]
    w = torch.randn(2, 16)
    previous = op_module.set_kernel("auto")
    try:
        state = fused.partial(x[:3], w, 1e-6, -1)
        assert state is not None and state[2].shape == (2, 3, 4, 16)
        assert fused.merge(*state, 1, x[3:], w[1], 1e-6, 4.0, -1) is not None
        assert fused.partial([t.double() for t in x[:3]], w, 1e-6, -1) is None
        op_module.set_kernel("eager")
        monkeypatch.setattr(fused, "partial", lambda *a: pytest.fail("the fused partial ran in mode eager"))
        monkeypatch.setattr(fused, "merge", lambda *a: pytest.fail("the fused merge ran in mode eager"))
        merge(*partial(x[:3], w, 1e-6, -1), 0, x[3:], w[0], 1e-6, 4.0, -1)
    finally:
        op_module.set_kernel(previous)


def test_partial_chains_keep_the_previous_groups_links():
    """A group's partial chain is the previous group's (over a prefix of its history) plus links of at
    most PARTIAL_CHUNK sources: Full's groups then share two link kernels. A short history is one
    link; one that does not extend the previous chain starts afresh."""
    chunk, bounds, chains = kernel_cache.PARTIAL_CHUNK, [0], []
    for length in (15, 22, 29, 36, 43):
        bounds = kernel_cache.partial_links(bounds, length)
        chains.append(bounds)
    assert chains[-1] == [0, 8, 15, 22, 29, 36, 43] and all(c == chains[-1][:len(c)] for c in chains)
    assert kernel_cache.partial_links([0], chunk) == [0, chunk]
    assert kernel_cache.partial_links([0, 8, 15], 12) == [0, 8, 12]
    assert kernel_cache.partial_links([0], 2 * chunk + 3) == [0, chunk, 2 * chunk, 2 * chunk + 3]


def test_long_history_runs_as_a_chain_of_links():
    """19 sources: the fused partial runs links of 8, 8 and 3 (the last two continuing the state) and
    equals the eager reference over all 19 at once."""
    g = torch.Generator().manual_seed(5)
    history = [torch.randn(2, 9, 32, generator=g) * (1 + i % 3) for i in range(19)]
    queries = torch.randn(3, 32, generator=g)
    previous = op_module.set_kernel("auto")
    try:
        fused._KERNELS.clear()
        chained = fused.partial(history, queries, 1e-6, -1)
        used = sorted((k[0], k[1]) for k, fn in fused._KERNELS.items() if fn is not False)
        op_module.set_kernel("eager")
        reference = partial(history, queries, 1e-6, -1)
    finally:
        op_module.set_kernel(previous)
    assert used == [("partial", 8), ("partial_link", 3), ("partial_link", 8)]
    for got, ref in zip(chained, reference):  # float32 sums of 19 terms, added in another order
        assert _rel(got, ref) <= len(history) * torch.finfo(torch.float32).eps


def test_gradcheck():
    """The pair's gradient (the differentiable reference, m and the running max held constant) is
    the exact one, for the history, the extras and the queries."""
    g = torch.Generator().manual_seed(1)
    leaves = [torch.randn(3, 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(5)]
    queries = torch.randn(2, 8, generator=g, dtype=torch.float64, requires_grad=True)

    def pair(*args):
        m, l, acc = partial(list(args[:3]), args[5], 1e-6, -1)
        return merge(m, l, acc, 1, list(args[3:5]), args[5][1], 1e-6, 5.0, -1)

    assert torch.autograd.gradcheck(pair, (*leaves, queries))


def test_opcheck():
    history = [torch.randn(2, 6, 16, requires_grad=True) for _ in range(3)]
    queries = torch.randn(4, 16, requires_grad=True)
    checks = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(partial, (history, queries, 1e-6, -1), test_utils=checks)
    m, l, acc = (t.detach() for t in partial(history, queries, 1e-6, -1))
    extra = [torch.randn(2, 6, 16, requires_grad=True)]
    torch.library.opcheck(merge, (m, l, acc, 1, extra, torch.randn(16, requires_grad=True), 1e-6, 4.0, -1),
                          test_utils=checks)


def test_bad_arguments_raise_clear_errors():
    x = [torch.randn(2, 4) for _ in range(2)]
    with pytest.raises(ValueError, match=r"queries must have shape \[B, D\]"):
        partial(x, torch.zeros(4), 1e-6, -1)
    with pytest.raises(ValueError, match="query must have shape"):
        partial(x, torch.zeros(2, 5), 1e-6, -1)
    with pytest.raises(ValueError, match="one shape and device"):
        merge(*partial(x, torch.zeros(1, 4), 1e-6, -1), 0, [x[0], torch.randn(2, 5)], torch.zeros(4), 1e-6, 3.0, -1)


# ---- the fx pass ---------------------------------------------------------------------------------

def _model(name: str, layers: int):
    torch.manual_seed(0)
    if name == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=layers, n_head=2, bos_token_id=0,
                                           eos_token_id=0))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2))
    ids = torch.randint(0, 100, (2, 12))
    return model.eval(), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}


def _ops(gm) -> dict[str, int]:
    return dict(collections.Counter(n.target.__name__.split(".")[0] for n in gm.graph.nodes
                                    if n.op == "call_function" and str(n.target).startswith("attnres.")))


def _trained(gm) -> None:
    """Queries as after training: random, so the softmax over depth is not uniform."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in gm.named_parameters():
            if name.startswith("attnres."):
                p.copy_(torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("name", [pytest.param("gpt2", marks=pytest.mark.heavy), "llama"])
def test_full_chain_becomes_partials_and_merges(name):
    """Full over 16 sublayers: groups of 4 sites; with histories from 3 sources up, three groups run
    two-phase (histories 5, 9, 13), the first stays one-pass. Outputs and every parameter's gradient
    equal the one-pass graph's to float32 reassociation; a second pass finds nothing to do."""
    model, inputs = _model(name, 8)
    one = ac.rewrite(model, inputs, ac.AttnResConfig(variant="full")).graph_module
    _trained(one)
    two = ac.rewrite(model, inputs, ac.AttnResConfig(variant="full")).graph_module
    two.load_state_dict(one.state_dict())
    result = ac.two_phase(two, min_history=3)
    assert result.modified and result.graph_module is two
    two.graph.lint()
    assert _ops(two) == {"depth_attention": 4, "depth_attention_partial": 3, "depth_attention_merge": 12}
    assert not ac.two_phase(two, min_history=3).modified
    with torch.no_grad():
        assert _rel(two(**inputs).logits, one(**inputs).logits) <= 1e-5
    grads = []
    for gm in (one, two):
        gm(**inputs).logits.square().mean().backward()
        grads.append({n: p.grad for n, p in gm.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for n, ref in grads[0].items():
        assert _rel(grads[1][n], ref) <= 1e-4, n


def test_short_histories_stay_one_pass():
    """By default a history needs 12 sources (core/two_phase.py's MIN_HISTORY, the TVM lowering's rule):
    Block's histories (N=4 here: at most 4) never reach it, Full's last group at 16 sublayers does."""
    model, inputs = _model("gpt2", 8)
    block = ac.rewrite(model, inputs, ac.AttnResConfig(variant="block", num_blocks=4)).graph_module
    assert not ac.two_phase(block).modified
    full = ac.rewrite(model, inputs, ac.AttnResConfig(variant="full")).graph_module
    assert ac.two_phase(full).modified
    assert _ops(full) == {"depth_attention": 12, "depth_attention_partial": 1, "depth_attention_merge": 4}


def test_saved_program_round_trip():
    """A .pt2 program's module (queries as get_attr nodes at the top) takes the pass; the two-phase
    module exports with the pair as single nodes, saves and loads, and computes the same."""
    model, inputs = _model("gpt2", 4)
    gm = ac.rewrite(model, inputs, ac.AttnResConfig(variant="full")).graph_module
    _trained(gm)
    args = (inputs["input_ids"], inputs["attention_mask"])

    def round_trip(module):
        buf = io.BytesIO()
        torch.export.save(torch.export.export(module, args), buf)
        buf.seek(0)
        return torch.export.load(buf).module()

    loaded = round_trip(hf_models.CausalLMLogits(gm))
    with torch.no_grad():
        ref = loaded(*args)
        assert ac.two_phase(loaded, min_history=3).modified
        assert _rel(loaded(*args), ref) <= 1e-5
        again = round_trip(loaded)
        assert _ops(again) == _ops(loaded)
        assert _rel(again(*args), ref) <= 1e-5


def test_exporters_and_reanalysis_take_the_two_phase_form():
    """`one_pass` undoes the pass (the same op calls, bit-identical outputs); the ONNX exporter, the
    TVM importer and `rewrite` read a two-phase module as the one-pass module it came from."""
    from attnres_compile.backends.tvm.importers import import_model
    from attnres_compile.fx.two_phase import one_pass
    from attnres_compile.onnx.export import export
    from attnres_compile.onnx.two_phase import sites as onnx_sites

    model, inputs = _model("gpt2", 4)
    gm = ac.rewrite(model, inputs, ac.AttnResConfig(variant="full")).graph_module
    _trained(gm)
    args = (inputs["input_ids"], inputs["attention_mask"])
    with torch.no_grad():
        ref = gm(**inputs).logits
    canonical = _ops(gm)
    two = ac.two_phase(copy.deepcopy(gm), min_history=3).graph_module
    assert _ops(two)["depth_attention_merge"] == 5  # sites 4-6 and 7-8 over histories of 4 and 7 sources
    forms = {"one-pass": gm, "two-phase": two}

    onnx_form = {k: [len(s.sources) for s in onnx_sites(export(hf_models.CausalLMLogits(m), args).graph)]
                 for k, m in forms.items()}
    assert onnx_form["two-phase"] == onnx_form["one-pass"] == list(range(2, 10))
    tvm_sites = {k: import_model(torch.export.export(hf_models.CausalLMLogits(m), args)).sites for k, m in forms.items()}
    assert [s["sources"] for s in tvm_sites["two-phase"]] == [s["sources"] for s in tvm_sites["one-pass"]]
    again = ac.rewrite(two, inputs, ac.AttnResConfig(variant="full"))
    assert not again.modified and "already rewritten" in " ".join(again.report["notes"])
    assert one_pass(two).modified and not one_pass(two).modified
    two.graph.lint()
    assert _ops(two) == canonical
    with torch.no_grad():
        assert torch.equal(two(**inputs).logits, ref)


def test_monitor_refuses_the_two_phase_form():
    """DepthMonitor watches depth_attention nodes: on a two-phase module it would miss the merged
    sites, so it says so instead of watching a part."""
    from attnres_compile.monitor import DepthMonitor

    model, inputs = _model("gpt2", 8)
    gm = ac.rewrite(model, inputs, ac.AttnResConfig(variant="full")).graph_module
    ac.two_phase(gm, min_history=3)
    with pytest.raises(ValueError, match="two-phase form"):
        DepthMonitor(gm)
