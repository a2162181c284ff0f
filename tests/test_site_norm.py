"""The fused site + norm pair: the op `attnres.depth_attention_norm` (ops/site_norm.py) against the
unfused pair and float64, and the fx pass that puts it in rewritten HF models (fx/site_norm.py).

In mode eager the pair computes the unfused ops themselves, so a fused model's outputs equal the
unfused one's bit for bit; its gradients come from the analytic backward, equal to autograd's
through the unfused ops up to float32 rounding. The fused TVM kernels (mode auto) differ from the
eager pair by float32 rounding in both directions."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import attnres_compile as ac
from attnres_compile.ops import depth_attention as op_module
from attnres_compile.monitor import DepthMonitor
from attnres_compile.ops.site_norm import norm_reference
from attnres_compile.fx.site_norm import PAIR, SITE, fuse_norms, unfuse_norms
from samples import hf_models, hf_zoo, models

pair = torch.ops.attnres.depth_attention_norm.default
NORMS = [("layer", True, True), ("layer", False, False), ("rms", True, False), ("rms", False, False)]


def _inputs(size=64, rows=(2, 5), count=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    sources = [(torch.randn(*rows, size, generator=g) + i).requires_grad_() for i in range(count)]
    return sources, (torch.randn(size, generator=g) / size**0.5).requires_grad_(), g


@pytest.fixture
def eager():
    previous = op_module.set_kernel("eager")
    yield
    op_module.set_kernel(previous)


@pytest.mark.parametrize("mode, kind, weight, bias", [("eager", *n) for n in NORMS] + [("auto", "rms", False, False)])
def test_pair_equals_the_unfused_site_and_norm(mode, kind, weight, bias):
    """Outputs and every gradient (sources, query, weight, bias), with a gradient on `mixed` too (a
    site read by its norm and something else), against the unfused ops under autograd: equal in mode
    eager, within float32 rounding of the outputs' scale with the fused kernels (one configuration
    here: the others are GPT-2's below and tests/test_tvm_kernel.py's)."""
    previous = op_module.set_kernel(mode)
    try:
        sources, query, g = _inputs()
        w = torch.randn(64, generator=g).requires_grad_() if weight else None
        b = torch.randn(64, generator=g).requires_grad_() if bias else None
        params = [t for t in (*sources, query, w, b) if t is not None]
        up_n, up_m = torch.randn(2, 5, 64, generator=g), torch.randn(2, 5, 64, generator=g)
        mixed, normed = pair(sources, query, 1e-6, 3.0, -1, w, b, 1e-5, kind)
        got = torch.autograd.grad((normed * up_n).sum() + (mixed * up_m).sum(), params)
        ref_mixed = torch.ops.attnres.depth_attention(sources, query, 1e-6, 3.0, -1)
        ref_normed = norm_reference(ref_mixed, w, b, 1e-5, kind)
        want = torch.autograd.grad((ref_normed * up_n).sum() + (ref_mixed * up_m).sum(), params)
        if mode == "eager":
            assert torch.equal(mixed, ref_mixed) and torch.equal(normed, ref_normed)
        for a, r in [(mixed, ref_mixed), (normed, ref_normed), *zip(got, want)]:
            torch.testing.assert_close(a, r, rtol=0, atol=1e-5 * float(r.detach().abs().max()))
    finally:
        op_module.set_kernel(previous)


@pytest.mark.parametrize("kind, bias", [("layer", True), ("rms", False)])
def test_gradcheck_float64(kind, bias):
    g = torch.Generator().manual_seed(1)
    sources = [torch.randn(2, 2, 6, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(3)]
    query, weight = (torch.randn(6, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    b = torch.randn(6, dtype=torch.float64, generator=g, requires_grad=True) if bias else None

    def both(query, weight, *sources):
        return pair(list(sources), query, 1e-6, 3.0, -1, weight, b, 1e-5, kind)

    def normed_only(query, *sources):  # `mixed` unread: the backward gets no gradient for it
        return pair(list(sources), query, 1e-6, 3.0, -1, None, None, 1e-5, kind)[1]

    assert torch.autograd.gradcheck(both, (query, weight, *sources), fast_mode=True)
    assert torch.autograd.gradcheck(normed_only, (query, *sources), fast_mode=True)


def test_export_keeps_the_pair_one_node():
    class Tail(nn.Module):
        def __init__(self):
            super().__init__()
            self.query, self.norm = nn.Parameter(torch.randn(16)), nn.LayerNorm(16)

        def forward(self, a, b):
            return pair([a, b], self.query, 1e-6, 2.0, -1, self.norm.weight, self.norm.bias, 1e-5, "layer")[1]

    args = (torch.randn(2, 3, 16), torch.randn(2, 3, 16))
    program = torch.export.export(Tail(), args)
    assert [n.target for n in program.graph.nodes if n.op == "call_function"].count(PAIR) == 1
    model = Tail()
    torch.testing.assert_close(torch.export.export(model, args).module()(*args), model(*args))


def test_bad_arguments_are_refused_in_one_line():
    sources, query, _ = _inputs(size=8)
    with pytest.raises(ValueError, match="dim must be -1"):
        pair(sources, query, 1e-6, 1.0, 1, None, None, 1e-5, "rms")
    with pytest.raises(ValueError, match="an RMSNorm has no bias"):
        pair(sources, query, 1e-6, 1.0, -1, None, torch.zeros(8), 1e-5, "rms")
    with pytest.raises(ValueError, match="norm_kind must be one of layer, rms"):
        pair(sources, query, 1e-6, 1.0, -1, None, None, 1e-5, "group")
    with pytest.raises(ValueError, match=r"norm_weight must have shape \[8\]"):
        pair(sources, query, 1e-6, 1.0, -1, torch.ones(4), None, 1e-5, "layer")


# ---- the fx pass on rewritten models ---------------------------------------------------------------

def _other_norms():
    """The sample PreNorm GPT with its attention norms as nn.RMSNorm (aten.rms_norm with a weight) and
    its MLP and final norms as LayerNorms without parameters."""
    model, inputs = models.gpt_factory(layers=2)
    for name, module in list(model.named_modules()):
        for child, norm in list(module.named_children()):
            if isinstance(norm, nn.LayerNorm):
                size = norm.normalized_shape[0]
                setattr(module, child, nn.RMSNorm(size) if child == "ln1" else nn.LayerNorm(size, elementwise_affine=False))
    return model.eval(), inputs


FACTORIES = {
    "llama": hf_models.llama_factory,  # HF RMSNorm, torch.export's casts and metadata checks
    "qwen2": hf_zoo.qwen2_factory,
    "gpt2": hf_models.gpt2_factory,  # aten.layer_norm with weight and bias
    "other_norms": _other_norms,  # aten.rms_norm with a weight, aten.layer_norm without parameters
    "opt": hf_models.opt_factory,  # the norm reads the site viewed as [batch * seq, D]
}
KINDS = {"llama": ("rms", True, False), "qwen2": ("rms", True, False), "gpt2": ("layer", True, True),
 "other_norms": ("rms", True, False),
         "opt": ("layer", True, True)}


def _outputs(module, inputs):
    """The logits and, of an HF model, its hidden states (sites returned beside their norm: `mixed`)."""
    out = module(*inputs) if isinstance(inputs, tuple) else module(**inputs)
    return [out.logits, *(out.hidden_states or ())] if hasattr(out, "logits") else [out]


@pytest.mark.parametrize("name", list(FACTORIES))
def test_pass_fuses_every_site_and_is_exact(eager, name):
    """Every site of a PreNorm model is read by a norm (the next sublayer's, or the final one) and
    becomes a pair, also where it is returned as a hidden state (that reader gets `mixed`); logits
    and hidden states equal bit for bit, every parameter's gradient within float32 rounding."""
    model, inputs = FACTORIES[name]()
    if isinstance(inputs, dict):
        inputs = {**inputs, "output_hidden_states": True}
    gm = ac.rewrite(model, inputs, ac.AttnResConfig(variant="full"), verify_outputs=False).graph_module
    fused = copy.deepcopy(gm)
    assert fuse_norms(fused).modified
    sites = [n for n in gm.graph.nodes if n.target is SITE]
    pairs = [n for n in fused.graph.nodes if n.target is PAIR]
    assert len(pairs) == len(sites) >= (2 if name == "opt" else 4) and not any(n.target is SITE for n in fused.graph.nodes)
    kinds = {(n.args[8], n.args[5] is not None, n.args[6] is not None) for n in pairs}
    assert kinds == ({KINDS[name]} if name != "other_norms" else {KINDS[name], ("layer", False, False)})
    params = [dict(gm.named_parameters()), dict(fused.named_parameters())]
    for p in (*params[0].values(), *params[1].values()):
        p.requires_grad_(True)
    before, after = _outputs(gm, inputs), _outputs(fused, inputs)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    grads = [torch.autograd.grad(out[0].square().sum(), list(p.values()), allow_unused=True)
             for out, p in zip((before, after), params)]
    # float32 rounding of the largest gradient: a parameter whose gradient is zero but for rounding (a
    # key projection's bias under softmax) differs by noise of that scale, not of its own
    scale = max(float(a.abs().max()) for a in grads[0] if a is not None)
    for key, a, b in zip(params[0], *grads):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=2e-5, atol=2e-6 * scale, msg=key)
    assert not fuse_norms(fused).modified  # nothing left to fuse
    with pytest.raises(ValueError, match="fused with their norms"):
        DepthMonitor(fused)
    assert unfuse_norms(fused).modified and torch.equal(_outputs(fused, inputs)[0], before[0])
    assert [n.target for n in fused.graph.nodes].count(SITE) == len(sites)


def test_pass_with_the_fused_kernels_matches_the_unfused_model():
    """GPT-2 (one layer: two sites, one kernel per source count) with the fused TVM kernels: the
    logits and gradients of the unfused model within float32 rounding."""
    model, inputs = hf_models.gpt2_factory(layers=1)
    gm = ac.rewrite(model, inputs, ac.AttnResConfig(variant="full"), verify_outputs=False).graph_module
    fused = copy.deepcopy(gm)
    fuse_norms(fused)
    outs, grads = [], []
    for module in (gm, fused):
        params = [p.requires_grad_(True) for p in module.parameters()]
        outs.append(_outputs(module, inputs)[0])
        grads.append(torch.autograd.grad(outs[-1].square().sum(), params, allow_unused=True))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-5 * float(outs[0].detach().abs().max()))
    for a, b in zip(*grads):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=0, atol=1e-4 * float(a.abs().max()) + 1e-12)


# ---- the ONNX file and the TVM lowering ------------------------------------------------------------

def _site_kernels(imported) -> dict:
    from attnres_compile.backends.tvm import pipeline
    from attnres_compile.backends.tvm.lower import KERNEL_PREFIX, calls

    lowered, _ = pipeline.lower(imported.mod, pipeline.make_target("llvm"), len(imported.sites))
    return {k: n for k, n in calls(lowered).items() if k.startswith(KERNEL_PREFIX)}


def test_onnx_keeps_the_pair_one_function_node_and_tvm_runs_it_as_one_kernel(tmp_path):
    """A fused Llama exported to ONNX: every pair is one attnres.DepthAttentionNorm function node that
    check_sites accepts and onnxruntime runs (the torch model's logits within float32 rounding);
    TVM's importer maps each pair, from the ONNX file and from the torch program, onto the lowering's
    fused-norm site kernel (`_rms`), and the ONNX file compiles and matches onnxruntime."""
    import onnxruntime as ort

    from attnres_compile.backends.tvm import importers
    from attnres_compile.backends.tvm.artifact import compile_model
    from attnres_compile.onnx.export import export
    from attnres_compile.onnx.function import PAIR as ONNX_PAIR
    from attnres_compile.onnx.io import write
    from attnres_compile.onnx.site_check import check_sites

    model, inputs = hf_models.llama_factory(layers=1)
    gm = ac.rewrite(model, inputs, ac.AttnResConfig(variant="full"), verify_outputs=False).graph_module
    fuse_norms(gm)
    proto = export(gm, (), inputs)
    assert [n.op_type for n in proto.graph.node if n.domain == "attnres"] == [ONNX_PAIR] * 2
    assert check_sites(proto) == 2
    path = tmp_path / "llama.onnx"
    write(proto, path)
    session = ort.InferenceSession(str(path))
    got = session.run(None, {i.name: inputs[i.name].numpy() for i in session.get_inputs()})[0]
    want = gm(**inputs).logits.detach().numpy()
    torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), rtol=0, atol=1e-5 * abs(want).max())
    expected = {"attnres_depth_attention_n2_d32_float32_rms": 1, "attnres_depth_attention_n3_d32_float32_rms": 1}
    assert _site_kernels(importers.import_model(path)) == expected
    assert _site_kernels(importers.import_model(torch.export.export(gm, (), inputs))) == expected
    compile_model(path, tmp_path / "tvm")  # builds, then checks its outputs against onnxruntime's


def test_a_damaged_pair_node_is_refused(tmp_path):
    import onnx

    from attnres_compile.core.errors import CorruptModelError
    from attnres_compile.onnx.function import pair_node
    from attnres_compile.onnx import passes
    from attnres_compile.onnx.site_check import check_sites

    x = [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [2, 4]) for n in ("a", "b")]
    q = onnx.numpy_helper.from_array(torch.zeros(4).numpy(), "q")
    node = pair_node(["a", "b"], "q", [], ["mixed", "normed"], eps=1e-6, scale=2.0, norm_eps=1e-5, norm="rms")
    out = [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [2, 4]) for n in ("mixed", "normed")]
    model = onnx.helper.make_model(onnx.helper.make_graph([node], "g", x, out, [q]),
                                   opset_imports=[onnx.helper.make_opsetid("", 17)])
    assert passes.run(model, [p() for p in passes.FINALIZE]) == {"group_sites": 0, "attach_functions": 1}
    assert check_sites(model) == 1
    for name, value in (("norm", b"group"), ("affine", 2), ("norm_eps", 0.0)):
        damaged = copy.deepcopy(model)
        attr = next(a for a in damaged.graph.node[0].attribute if a.name == name)
        setattr(attr, {"norm": "s", "affine": "i", "norm_eps": "f"}[name], value)
        with pytest.raises(CorruptModelError, match=f"attnres DepthAttentionNorm node .* is malformed: .*{name}"):
            check_sites(damaged)


def test_rewrite_onnx_fuses_the_norms_exporters_write(tmp_path):
    """rewrite_onnx(fuse_norms=True) on HF Llama as the TorchScript exporter writes it (the RMSNorm
    between float32 casts, 1 / sqrt as Div, its weights deduplicated behind Identity nodes): every
    site and its norm become one pair node, and the file matches the original in onnxruntime."""
    from attnres_compile.onnx.pipeline import rewrite_onnx
    from attnres_compile.onnx import io as onnx_io

    model, inputs = hf_models.llama_factory()
    path = tmp_path / "llama.onnx"
    names = ["input_ids", "attention_mask"]
    torch.onnx.export(hf_models.CausalLMLogits(model).eval(), tuple(inputs[n] for n in names), str(path), dynamo=False,
                      opset_version=17, input_names=names, output_names=["logits"],
                      dynamic_axes={n: {0: "batch", 1: "seq"} for n in [*names, "logits"]})
    result = rewrite_onnx(path, tmp_path / "out.onnx", ac.AttnResConfig(variant="full"), fuse_norms=True)
    assert all(row["ok"] for row in result.report["verification"])
    written = onnx_io.load(tmp_path / "out.onnx", with_data=False)
    assert [n.op_type for n in written.graph.node if n.domain == "attnres"] == ["DepthAttentionNorm"] * 4
