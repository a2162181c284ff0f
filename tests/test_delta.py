"""Delta AttnRes (variant="delta"): the stream stays the plain sum, the readers of site k (all but the
next link's skip) read h_k + g_k * sum_i softmax_i(w_k . RMSNorm(v_i)) v_i (DESIGN.md §2).

Checked here: the op (fused kernels and eager reference against a float64 reference, gate 0 bitwise
the plain sum, gradients), the semantics on a hand-written PreNorm model against a direct
implementation (Delta and Delta-Block, trained gates and queries), exactness at conversion on HF
Llama, GPT-2 and OPT (bitwise), the gradient order at a conversion (step 1 moves the gates only,
step 2 the queries), and the bad inputs (one line each)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attnres_compile as ac
from attnres_compile import AttnResConfig
from attnres_compile.core.errors import ConfigError
from attnres_compile.ops.delta import backward_reference, depth_attention_delta
from samples.hf_models import gpt2_factory, llama_factory, opt_factory


def _float64(sources, w, base, gate, eps=1e-6):
    v = torch.stack([s.double() for s in sources])
    k = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    p = torch.einsum("d,s...d->s...", w.double(), k).softmax(0)
    return base.double() + gate.double() * torch.einsum("s...,s...d->...d", p, v)


@pytest.mark.parametrize("num", [3, 20])  # 20: the fused forward's and backward's chained form (> 16 sources)
def test_op_matches_float64_and_gate_zero_is_the_plain_sum(kernel, num):
    g = torch.Generator().manual_seed(num)
    sources = [torch.randn(2, 5, 32, generator=g) * (i + 1) for i in range(num)]
    base, w = torch.randn(2, 5, 32, generator=g), torch.randn(32, generator=g)
    assert torch.equal(depth_attention_delta(sources, w, base, torch.zeros(1), 1e-6, 1.0, -1), base)
    gate = torch.tensor([0.7])
    out = depth_attention_delta(sources, w, base, gate, 1e-6, 1.0, -1)
    ref = _float64(sources, w, base, gate)
    torch.testing.assert_close(out.double(), ref, atol=1e-6 * float(ref.abs().max()), rtol=1e-5)
    # gradients against autograd through the float64 form
    leaves = [s.double().requires_grad_() for s in sources]
    wl, bl, gl = (t.double().requires_grad_() for t in (w, base, gate))
    grad = torch.randn(2, 5, 32, generator=g)
    _float64(leaves, wl, bl, gl).backward(grad.double())
    got = [t.requires_grad_() for t in (w.clone(), base.clone(), gate.clone())]
    src = [s.clone().requires_grad_() for s in sources]
    depth_attention_delta(src, got[0], got[1], got[2], 1e-6, 1.0, -1).backward(grad)
    for mine, want in zip([*src, *got], [*leaves, wl, bl, gl]):
        torch.testing.assert_close(mine.grad.double(), want.grad, atol=2e-5 * float(want.grad.abs().max()), rtol=1e-4)


def test_op_gradcheck():
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(3, 8, dtype=torch.float64, generator=g).requires_grad_() for _ in range(5)]
    fn = lambda w, b, gate, *s: depth_attention_delta(list(s), w, b, gate, 1e-6, 1.0, -1)  # noqa: E731
    gate = torch.tensor([0.4], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fn, (inputs[0][0].detach().requires_grad_(), inputs[1], gate, *inputs[2:]))
    grads, _, dgate = backward_reference([i.detach() for i in inputs[2:]], inputs[0][0].detach(), gate.detach(),
                                         torch.ones(3, 8, dtype=torch.float64), 1e-6, 1.0, -1)
    assert dgate.shape == gate.shape and len(grads) == 3


class PreNorm(nn.Module):
    """emb -> L sublayers h = h + f_i(norm_i(h)) -> final norm: the chain's sites are read by the next
    norm (and the last by the final norm), so Delta is h + g * mix there."""

    def __init__(self, sublayers=6, dim=16):
        super().__init__()
        self.emb = nn.Embedding(50, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(sublayers))
        self.fs = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(sublayers))
        self.final = nn.LayerNorm(dim)

    def forward(self, ids):
        h = self.emb(ids)
        for norm, f in zip(self.norms, self.fs):
            h = h + f(norm(h))
        return self.final(h)


def _mix(terms, w, eps=1e-6):
    v = torch.stack(terms)
    p = torch.einsum("d,s...d->s...", w, v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)).softmax(0)
    return torch.einsum("s...,s...d->...d", p, v)


def _delta_reference(model, ids, queries, gates, block):
    """Delta AttnRes written out: the stream h is the plain sum; sublayer i+1's norm (and the final norm)
    reads h + g * mix over [v_0] + the block sums (complete or partial) of v_1..v_i."""
    h = model.emb(ids)
    vs, read = [h], h
    for i, (norm, f) in enumerate(zip(model.norms, model.fs)):
        v = f(norm(read))
        h = h + v
        vs.append(v)
        terms = [vs[0]] + [sum(vs[1:][j:j + block]) for j in range(0, len(vs) - 1, block)]
        read = h + gates[i] * _mix(terms, queries[i])
    return model.final(read)


@pytest.mark.parametrize("blocks", [None, 3])  # Delta; Delta-Block with N = 3 (B = 2)
def test_semantics_against_a_direct_implementation(blocks):
    torch.manual_seed(0)
    model = PreNorm().eval()
    ids = torch.randint(0, 50, (2, 7))
    result = ac.rewrite(model, (ids,), AttnResConfig(variant="delta", num_blocks=blocks))
    gm = result.graph_module
    assert result.report["summary"]["sites_rewritten"] == 6
    assert torch.equal(gm(ids), model(ids))
    queries = [torch.randn(16) for _ in range(6)]
    gates = [torch.randn(()) for _ in range(6)]
    with torch.no_grad():
        for k in range(6):
            gm.get_parameter(f"attnres.chain0.site{k + 1}").copy_(queries[k])
            gm.get_parameter(f"attnres.chain0.gate{k + 1}").copy_(gates[k])
        want = _delta_reference(model, ids, queries, gates, 1 if blocks is None else 2)
        torch.testing.assert_close(gm(ids), want, rtol=1e-5, atol=1e-5)


FACTORIES = {"llama": llama_factory, "gpt2": gpt2_factory, "opt": lambda: opt_factory(layers=2)}


def _logits(out):
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out.logits if hasattr(out, "logits") else out["logits"] if isinstance(out, dict) else out


@pytest.mark.parametrize("name, blocks", [("llama", 2), ("gpt2", None), ("opt", 2)])  # Delta-Block, Delta, Delta-Block
def test_exact_at_conversion_and_gates_learn_first(name, blocks, one_thread):
    """Rewritten == original bitwise; AdamW step 1 moves every gate and no query (the queries' gradient
    is the gate times theirs: 0), step 2 moves every query."""
    model, inputs = FACTORIES[name]()
    result = ac.rewrite(model, inputs, AttnResConfig(variant="delta", num_blocks=blocks))
    gm = result.graph_module
    assert all(r["verdict"] == "pass" for r in result.report["verification"])
    sites = result.report["summary"]["sites_rewritten"]
    assert sites == 4 and [s["gate"] for c in result.report["chains"] for s in c["sites"]][0] == "attnres.chain0.gate1"
    with torch.no_grad():
        assert torch.equal(_logits(gm(**inputs)), _logits(model(**inputs)))
    gates = [p for n, p in gm.named_parameters() if n.startswith("attnres.") and ".gate" in n]
    queries = [p for n, p in gm.named_parameters() if n.startswith("attnres.") and ".site" in n]
    assert len(gates) == len(queries) == sites
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-3)
    moved = []
    for _ in range(2):
        _logits(gm(**inputs)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        moved.append((sum(bool(g.detach().abs().max() > 0) for g in gates),
                      sum(bool(q.detach().abs().max() > 0) for q in queries)))
    assert moved == [(sites, 0), (sites, sites)]


def test_llamas_same_dtype_casts_are_read_through_not_copied():
    """Llama's norm reads h_k through a `to(float32)` it shares with the next link's skip: the norm reads
    the Delta output itself (the cast returns its input), and the metadata checks stay on h_k, so the
    rewritten graph holds the original's casts and checks, no more (23 casts and 46 checks more at 24
    sublayers cost Delta-Block about 0.33 ms, 0.7 points, of Llama's 48 ms eager forward at width 256)."""
    from attnres_compile.fx.trace import trace

    model, inputs = FACTORIES["llama"]()
    targets = (torch.ops.aten.to.dtype, torch.ops.aten._assert_tensor_metadata.default)

    def count(gm):
        return [sum(n.target is t for n in gm.graph.nodes) for t in targets]

    original = count(trace(model, inputs).graph_module)
    result = ac.rewrite(model, inputs, AttnResConfig(variant="delta", num_blocks=2))
    assert all(r["verdict"] == "pass" for r in result.report["verification"])
    assert original[0] > 0 and count(result.graph_module) == original


class PostNorm(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.fs = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(3))

    def forward(self, x):
        for f, norm in zip(self.fs, self.norms):
            x = norm(x + f(x))
        return x


def test_bad_inputs_one_line_each():
    x = torch.randn(2, 16)
    report = ac.inspect(PostNorm(), (x,), AttnResConfig(variant="delta"))
    reasons = [c["reason"] for c in report["chains"]]
    assert reasons and all("allow_nonlinear" in r and "\n" not in r for r in reasons)
    report = ac.inspect(PostNorm(), (x,), AttnResConfig(variant="delta", allow_nonlinear=True))
    (chain,) = report["chains"]
    assert chain["status"] == "skipped" and "not a pure sum" in chain["reason"] and "\n" not in chain["reason"]
    for bad, match in [(dict(variant="delta", init="zero"), "init must be one of"),
                       (dict(variant="block", num_blocks=2, init="paper"), "init='paper' applies to variant 'delta'"),
                       (dict(variant="delta", scale="paper"), "scale applies to variants full and block"),
                       (dict(variant="delta", num_blocks=2, block_size=2), "at most one of")]:
        with pytest.raises(ConfigError, match=match) as info:
            AttnResConfig(**bad)
        assert "\n" not in str(info.value)


def test_init_paper_starts_the_gates_at_one_and_says_it_changes_the_function():
    model, inputs = gpt2_factory()
    result = ac.rewrite(model, inputs, AttnResConfig(variant="delta", num_blocks=2, init="paper"))
    gates = [p for n, p in result.graph_module.named_parameters() if ".gate" in n and n.startswith("attnres.")]
    assert gates and all(float(g.detach()) == 1.0 for g in gates)
    assert result.report["summary"]["changes_function"]
    assert all(r["verdict"] == "none" for r in result.report["verification"])
    assert "variant=delta-block (N=2)  init=paper" in str(result.report)


# ---- ONNX and TVM ---------------------------------------------------------

def _onnx_original(tmp_path, name):
    import onnx

    from attnres_compile.onnx import export as onnx_export

    model, inputs = FACTORIES[name]()
    path = tmp_path / f"{name}.onnx"
    onnx.save(onnx_export.export(model, (), dict(inputs)), path)
    return model, inputs, path


def test_rewrite_onnx_is_exact_in_onnxruntime_and_tvm(tmp_path):
    """Delta-Block on an exported Llama: the rewrite verifies, runs bitwise as the original with
    onnxruntime's graph optimisations off (on, its SkipLayerNormalization fusion of the original's
    add and norm, which the rewrite's kept add no longer feeds alone, rounds otherwise: ~1 ulp), and
    its sites are DepthAttentionDelta nodes with [1] gates; TVM compiles the file (ONNX importer),
    each site one fused Delta kernel with the next RMSNorm applied, and matches onnxruntime."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from attnres_compile.backends.tvm import compile_model

    _, inputs, path = _onnx_original(tmp_path, "llama")
    out = tmp_path / "delta.onnx"
    result = ac.rewrite_onnx(path, out, AttnResConfig(variant="delta", num_blocks=2))
    assert all(r["verdict"] == "pass" for r in result.report["verification"])
    model = onnx.load(out)
    assert [n.op_type for n in model.graph.node if n.domain == "attnres"] == ["DepthAttentionDelta"] * 4
    gates = [i for i in model.graph.initializer if ".gate" in i.name]
    assert len(gates) == 4 and all(list(g.dims) == [1] for g in gates)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    feeds = {k: v.numpy() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    want, got = (ort.InferenceSession(p, options).run(None, feeds)[0] for p in (path, out))
    assert np.array_equal(want, got)
    # rewriting the rewritten file again finds its sites and nothing to do
    again = ac.inspect_onnx(out, AttnResConfig(variant="delta"))
    assert again["summary"]["existing_sites"] == 4 and again["summary"]["links"] == 0
    manifest = compile_model(out, tmp_path / "artifact")
    assert all(r["ok"] for r in manifest["verification"]["rows"])
    kernels = [s["kernel"] for s in manifest["sites"]]
    assert len(kernels) == 4 and all("_delta" in k and k.endswith("_rms") for k in kernels), kernels


def test_export_onnx_and_tvm_carry_trained_gates(tmp_path):
    """The fx rewrite with trained gates and queries: exported to ONNX, onnxruntime computes what
    torch does; compiled from its torch.export program (TVM's PyTorch importer), TVM too."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from attnres_compile.backends.tvm import compile_model
    from attnres_compile.onnx import export as onnx_export

    model, inputs = FACTORIES["gpt2"]()
    gm = ac.rewrite(model, inputs, AttnResConfig(variant="delta")).graph_module
    with torch.no_grad():
        for n, p in gm.named_parameters():
            if n.startswith("attnres."):
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(n)))
        want = _logits(gm(**inputs)).numpy()
    path = tmp_path / "trained.onnx"
    onnx.save(onnx_export.export(gm, (), dict(inputs)), path)
    got = ort.InferenceSession(path).run(None, {k: v.numpy() for k, v in inputs.items() if isinstance(v, torch.Tensor)})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert [n.op_type for n in onnx.load(path).graph.node if n.domain == "attnres"] == ["DepthAttentionDelta"] * 4
    manifest = compile_model(torch.export.export(gm, (), dict(inputs)), tmp_path / "artifact")
    assert manifest["verification"]["reference"] != "onnxruntime"
    assert all(r["ok"] for r in manifest["verification"]["rows"])
    assert [s["kernel"].endswith("_delta_ln") for s in manifest["sites"]] == [True] * 4


# ---- generation, monitor, distributed

def test_generation_with_a_kv_cache_gives_the_original_tokens():
    from attnres_compile.generation import causal_lm
    from samples.hf_decoders import DECODERS

    model, example = DECODERS["llama"]()
    result = ac.rewrite(model, example, AttnResConfig(variant="delta", num_blocks=2), with_past=True)
    assert all(r["verdict"] == "pass" for r in result.report["verification"])
    prompt = example["input_ids"][:, :6]
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False)
    got = causal_lm(model, result.graph_module).generate(prompt, attention_mask=torch.ones_like(prompt),
                                                                    max_new_tokens=16, do_sample=False)
    assert torch.equal(got, expected)


def test_monitor_reports_weights_and_gate_per_site():
    from attnres_compile.monitor import DepthMonitor

    model, inputs = FACTORIES["gpt2"]()
    gm = ac.rewrite(model, inputs, AttnResConfig(variant="delta", num_blocks=2)).graph_module
    with torch.no_grad():
        gm.get_parameter("attnres.chain0.gate2").fill_(0.25)
    monitor = DepthMonitor(gm)
    with monitor.watch():
        gm(**inputs)
    sites = monitor.stats()["sites"]
    assert len(sites) == 4 and [s["gate"] for s in sites] == [0.0, 0.25, 0.0, 0.0]
    assert all(abs(sum(s["weights"]) - 1) < 1e-5 for s in sites)


def test_pipeline_stages_relay_the_plain_stream_too():
    """split_stages of a Delta-Block GPT: the stages chained are the model (trained gates and queries);
    each hop carries Block's history and streams plus the plain sum, a second "stream" value."""
    from attnres_compile.distributed import split_stages
    from samples.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab=64, dim=32, layers=4, heads=2, max_len=16).eval()
    x = torch.randint(0, 64, (2, 16))
    gms = {name: ac.rewrite(model, (x,), config).graph_module for name, config in
           [("block", AttnResConfig(variant="block", num_blocks=2)), ("delta", AttnResConfig(variant="delta", num_blocks=2))]}
    with torch.no_grad():
        for n, p in gms["delta"].named_parameters():
            if n.startswith("attnres."):
                p.normal_(0, 0.5)
    plans = {}
    for name, gm in gms.items():
        stages, plans[name] = split_stages(gm, (x,), num_stages=4)
        out = (x,)
        for stage in stages:
            out = stage(*out)
            out = out if isinstance(out, tuple) else (out,)
        assert torch.equal(out[0], gm(x)), name
    for block, delta in zip(plans["block"].hops, plans["delta"].hops):
        kinds = lambda hop, k: sum(v.kind == k for v in hop.values)  # noqa: E731
        assert kinds(delta, "history") == kinds(block, "history") and kinds(delta, "stream") == 2
        assert delta.bytes == block.bytes + 2 * 16 * 32 * 4  # one more [2, 16, 32] float32 tensor


def test_pipeline_stages_on_two_gloo_ranks_train_as_one_process():
    """Delta-Block (N=2) GPT in 1F1B on 2 gloo ranks: the per-micro-batch losses and the gates' and
    queries' gradients of one process (samples/train_pipeline.py). The sample's gates get gradients of
    ~1e-7 (sums over rows that mostly cancel, ~3% apart in float32 between the two orders of
    accumulation) and, the gates barely moved, the queries ~1e-13 on step 2: each is compared to 1e-4 of
    itself, or 1e-8 (gates) or 1e-6 of the largest (queries)."""
    import torch.distributed as dist

    from samples import train_pipeline

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    ref = train_pipeline.reference("delta-block", steps=2)
    got = train_pipeline.run(("1f1b",), world=2, variant="delta-block", steps=2)["1f1b"]
    for g, w in zip(got["losses"], ref["losses"]):
        assert g == pytest.approx(w, abs=1e-6)
    for g, w in zip(got["grads"], ref["grads"]):
        assert g.keys() == w.keys() and any(".gate" in k for k in w)
        for k in w:
            assert g[k] == pytest.approx(w[k], rel=1e-4, abs=1e-8 if ".gate" in k else 1e-6 * max(map(abs, w[k]))), k
    assert all(w[0] != 0 for k, w in ref["grads"][0].items() if ".gate" in k)  # step 0: the gates learn,
    assert all(v == 0 for k, w in ref["grads"][0].items() if ".site" in k for v in w)  # the queries not yet
