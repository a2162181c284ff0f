"""Generation with a KV cache: the rewritten decoder-with-past against the original HF model.

HF `generate()` through `generation.causal_lm` and our own loop (generate_loop.greedy) over the
rewritten graph must give the original's greedy tokens, 64 new tokens, on five architectures
(dense, grouped-query, sliding window, MoE, GPT-2). With trained (random) pseudo-queries the
model is no longer the original, so the cache itself is checked: a decode step must give the
logits of recomputing the whole sequence.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnres_compile as ac
from attnres_compile.fx import decoder
from attnres_compile.generation import loop as generate_loop, serve as generation
from attnres_compile.core.errors import ConfigError, InputError
from samples.hf_decoders import DECODERS

NEW_TOKENS = 64
BLOCK2 = ac.AttnResConfig(variant="block", num_blocks=2)


@pytest.fixture(scope="module", params=sorted(DECODERS))
def rewritten(request):
    model, example = DECODERS[request.param]()
    result = ac.rewrite(model, example, BLOCK2, with_past=True)
    return request.param, model, example, result


def _empty(model, batch):
    geometry = decoder.probe(model, torch.zeros(1, 2, dtype=torch.long))[0]
    return geometry, {n: t.numpy() for n, t in zip(geometry.input_names()[3:], geometry.empty_past(batch))}


def test_rewrite_with_past_is_exact(rewritten):
    name, model, _, result = rewritten
    rows = result.report["verification"]
    assert [r["output"] for r in rows] == decoder.Geometry(2, (1, 1), (16, 16), torch.float32).output_names()
    assert all(r["verdict"] == "pass" for r in rows), (name, rows)
    assert result.report["summary"]["sites_rewritten"] == 4
    result.graph_module.graph.lint()
    # MoE experts traced with standard ops (hf_experts looks through the wrapper): ONNX and TVM can import them
    assert not [n for n in result.graph_module.graph.nodes if "transformers" in str(n.target)], name


def test_generate_matches_the_original(rewritten):
    """HF generate() on the rewritten decoder, and our loop over it, give the original's 64 tokens."""
    name, model, example, result = rewritten
    prompt = example["input_ids"][:, :6]
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert expected.shape[1] == 6 + NEW_TOKENS
    lm = generation.causal_lm(model, result.graph_module)
    got = lm.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(got, expected), name
    geometry, empty = _empty(model, prompt.shape[0])
    loop = generate_loop.greedy(generation.torch_step(result.graph_module, geometry.input_names()), prompt.numpy(),
                                empty, NEW_TOKENS)
    np.testing.assert_array_equal(loop.tokens, expected.numpy())


def test_prompts_of_one_to_three_tokens_generate(rewritten):
    """Issue 62 item 6: the traced mask's length (past + sequence) had a minimum of 4 that torch enforced,
    so HF generate() through causal_lm and our loop refused a prompt of 1 to 3 tokens."""
    name, model, example, result = rewritten
    lm = generation.causal_lm(model, result.graph_module)
    for length in (1, 2, 3):
        prompt = example["input_ids"][:1, :length]
        expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
        got = lm.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
        assert torch.equal(got, expected), (name, length)
        geometry, empty = _empty(model, 1)
        loop = generate_loop.greedy(generation.torch_step(result.graph_module, geometry.input_names()),
                                    prompt.numpy(), empty, 8)
        np.testing.assert_array_equal(loop.tokens, expected.numpy())


def test_left_padded_batch_generates_as_the_original():
    model, example = DECODERS["llama"]()
    result = ac.rewrite(model, example, BLOCK2, with_past=True, verify_outputs=False)
    prompt = example["input_ids"][:, :7].clone()
    mask = torch.ones_like(prompt)
    mask[0, :3] = 0  # row 0: a 4-token prompt, left-padded
    prompt[0, :3] = 0
    expected = model.generate(prompt, attention_mask=mask, max_new_tokens=16, do_sample=False)
    got = generation.causal_lm(model, result.graph_module).generate(prompt, attention_mask=mask, max_new_tokens=16,
                                                                     do_sample=False)
    assert torch.equal(got, expected)


def test_trained_queries_keep_the_cache_consistent():
    """With non-zero pseudo-queries (no longer the original's function), decoding token by token
    with the cache gives the logits of one forward over the whole sequence, and HF generate() on
    the rewritten decoder and our loop agree."""
    model, example = DECODERS["llama"]()
    result = ac.rewrite(model, example, BLOCK2, with_past=True, verify_outputs=False)
    gm = result.graph_module
    with torch.no_grad():
        for name, p in gm.named_parameters():
            if name.startswith("attnres"):
                p.copy_(torch.randn_like(p, generator=torch.Generator().manual_seed(1)) * 2)
    geometry, empty = _empty(model, 2)
    ids = example["input_ids"][:, :10]
    mask = torch.ones_like(ids)
    with torch.no_grad():
        whole = gm(ids, mask, decoder.positions(mask, 10), *geometry.empty_past(2))["logits"]
        first = gm(ids[:, :9], mask[:, :9], decoder.positions(mask[:, :9], 9), *geometry.empty_past(2))
        past = [first[n] for n in geometry.output_names()[1:]]
        last = gm(ids[:, 9:], mask, decoder.positions(mask, 1), *past)["logits"]
        plain = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(last[:, -1], whole[:, -1], rtol=1e-5, atol=1e-5 * whole.abs().max().item())
    assert (whole - plain).abs().max() > 1e-3  # the queries changed the function: the check above is not vacuous
    prompt = ids[:, :5]
    got = generation.causal_lm(model, gm).generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24,
                                                   do_sample=False)
    loop = generate_loop.greedy(generation.torch_step(gm, geometry.input_names()), prompt.numpy(), empty, 24)
    np.testing.assert_array_equal(loop.tokens, got.numpy())


def test_with_past_refusals():
    bert = __import__("samples.hf_models", fromlist=["bert_factory"]).bert_factory()
    with pytest.raises(InputError, match="with_past=True"):
        ac.rewrite(*bert, with_past=True)
    model, example = DECODERS["llama"]()
    with pytest.raises(ConfigError, match="dynamic"):
        ac.rewrite(model, example, with_past=True, dynamic="batch")


def test_eos_stops_rows_and_pads_them():
    model, example = DECODERS["gpt2"]()
    result = ac.rewrite(model, example, BLOCK2, with_past=True, verify_outputs=False)
    prompt = example["input_ids"][:, :4]
    free = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    eos = int(free[0, 6])  # row 0's third new token
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos)
    geometry, empty = _empty(model, 2)
    loop = generate_loop.greedy(generation.torch_step(result.graph_module, geometry.input_names()), prompt.numpy(),
                                empty, 12, eos_token_id=eos)
    np.testing.assert_array_equal(loop.tokens, expected.numpy())


def test_warm_up_builds_the_kernels_and_the_timed_run_builds_none(tmp_path, monkeypatch):
    """`generate` on a cold kernel cache timed the fused kernels' builds as the prefill (SmolLM2:
    "prefill 76679.4 ms ... decode 0.1 tokens/s"). The warm-up's prefill and decode step (at the
    prompt's shapes) build every kernel the run needs; the timed run builds none. The run is a
    left-padded batch on GPT-2, whose learned absolute positions must count from each row's first
    token (on Llama's rotary positions a shift changes nothing) to give HF generate()'s tokens."""
    from attnres_compile.ops import depth_attention as op_module
    from attnres_compile.kernels import cache, fused, schedule

    model, example = DECODERS["gpt2"]()
    result = ac.rewrite(model, example, BLOCK2, with_past=True, verify_outputs=False)
    monkeypatch.setenv("ATTNRES_KERNEL_CACHE", str(tmp_path / "kernels"))  # cold: an empty folder, nothing in memory
    for module, table in ((cache, "_MEMORY"), (cache, "_FOLDERS"), (fused, "_KERNELS")):
        monkeypatch.setattr(module, table, {})
    builds, build = [], schedule.build
    monkeypatch.setattr(schedule, "build", lambda *args: builds.append(args) or build(*args))
    previous = op_module.set_kernel("tvm")
    try:
        geometry, empty = _empty(model, 2)
        step = generation.torch_step(result.graph_module, geometry.input_names())
        prompt, mask = generate_loop.left_pad([[5, 17, 42, 8, 11, 60], [9, 3, 71]], 0)
        generate_loop.warm_up(step, prompt, empty, mask)
        warmed = len(builds)
        got = generate_loop.greedy(step, prompt, empty, 8, attention_mask=mask, pad_token_id=0)
    finally:
        op_module.set_kernel(previous)
    assert warmed > 0 and len(builds) == warmed, (warmed, len(builds))
    expected = model.generate(torch.from_numpy(prompt), attention_mask=torch.from_numpy(mask), max_new_tokens=8,
                              do_sample=False)
    np.testing.assert_array_equal(got.tokens, expected.numpy())
