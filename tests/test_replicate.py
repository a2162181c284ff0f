"""`convert` traces a deep decoder as three layers and copies the middle one (hf/replicate.py).

A converted model whose graph was grown from three traced layers must be the one a trace of the
whole model gives: with queries planted non-zero (so a site wired to the wrong source shows), the
logits are bitwise equal and greedy generation with the KV cache (every layer's cache output)
gives the same tokens. Where the layers differ — GPT-2 scaling attention by 1/(layer+1), Qwen2
with sliding-window layers above `max_window_layers` — the whole model is traced, and the
conversion is still exact. CI runs Llama and GPT-2's fall-back; `-m heavy` eight decoders × three
variants and Qwen2's fall-back (benchmarks/runs/heavy-tests/replicate.txt).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import attnres_compile as ac
from attnres_compile.hf import replicate
from samples import hf_decoders

LAYERS = 5
CONFIGS = {"block": ac.AttnResConfig(variant="block", num_blocks=3), "full": ac.AttnResConfig(),
           "delta": ac.AttnResConfig(variant="delta", num_blocks=3)}


def _model(arch: str, **extra):
    if arch.startswith("gpt2"):
        torch.manual_seed(0)
        config = tf.GPT2Config(n_layer=LAYERS, n_embd=32, n_head=2, vocab_size=hf_decoders.VOCAB, n_positions=128,
                               **extra)
        model = tf.GPT2LMHeadModel(config).eval()
        model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
        return model
    factory = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
               "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
               "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM),
               "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM), "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
               "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM)}[arch]
    return hf_decoders.decoder(*factory, num_hidden_layers=LAYERS, pad_token_id=0, **extra)[0]


def _convert(model, config, monkeypatch, replicated: bool | None):
    """`ac.convert`, with replication allowed (None: say which way it went) or turned off (False)."""
    grown = []
    real = replicate.deepen

    def spy(*args, **kwargs):
        grown.append(replicated is not False and real(*args, **kwargs))
        return grown[-1]

    with monkeypatch.context() as m:
        m.setattr(replicate, "deepen", spy)
        converted = ac.convert(model, config)
    return converted, bool(grown and grown[-1])


def _plant(*models) -> None:
    g = torch.Generator().manual_seed(1)
    params = [dict(m.named_parameters()) for m in models]
    for name, p in params[0].items():
        if "attnres" in name:
            value = torch.randn(p.shape, generator=g) * 0.5 + (0.3 if p.numel() == 1 else 0.0)  # Delta's gates too
            with torch.no_grad():
                for named in params:
                    named[name].copy_(value)


def _same_as_whole(arch: str, config, monkeypatch, **extra) -> None:
    model = _model(arch, **extra)
    grown, replicated = _convert(model, config, monkeypatch, None)
    assert replicated, f"{arch}: traced whole, expected three layers grown to {LAYERS}"
    whole, again = _convert(model, config, monkeypatch, False)
    assert not again
    _plant(grown, whole)
    ids = torch.randint(0, hf_decoders.VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = grown(input_ids=ids, use_cache=False).logits
        b = whole(input_ids=ids, use_cache=False).logits
        original = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(a, b)
    assert (a - original).abs().max() > 1e-3  # the planted queries change the function: the test can fail
    tokens = [m.generate(ids[:1, :6], max_new_tokens=10, do_sample=False) for m in (grown, whole)]
    assert torch.equal(*tokens)


def test_a_grown_llama_is_the_whole_trace(monkeypatch):
    _same_as_whole("llama", CONFIGS["block"], monkeypatch)


@pytest.mark.parametrize("arch, extra", [
    ("gpt2-inverse", {"scale_attn_by_inverse_layer_idx": True}),  # a constant per layer: 1/(layer+1)
    pytest.param("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 3},  # kinds mixed
                 marks=pytest.mark.heavy),
])
def test_layers_that_differ_are_traced_whole(arch, extra, monkeypatch):
    model = _model(arch, **extra)
    converted, replicated = _convert(model, CONFIGS["block"], monkeypatch, None)
    assert not replicated
    ids = torch.randint(0, hf_decoders.VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(converted(input_ids=ids, use_cache=False).logits,
                              model(input_ids=ids, use_cache=False).logits, atol=1e-5)


def test_a_shallow_config_keeps_per_layer_lists_in_step():
    config = tf.Qwen2Config(num_hidden_layers=6, layer_types=["sliding_attention"] * 3 + ["full_attention"] * 3,
                            use_sliding_window=True, sliding_window=4)
    short = replicate.shallow_config(config)
    assert (short.num_hidden_layers, short.layer_types) == (3, ["sliding_attention"] * 3)
    assert config.num_hidden_layers == 6 and len(config.layer_types) == 6


@pytest.mark.heavy
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2", "mistral", "gemma", "mixtral", "phi3", "olmo2"])
@pytest.mark.parametrize("variant", ["block", "full", "delta"])
def test_more_decoders_grow_as_traced_whole(arch, variant, monkeypatch):
    _same_as_whole(arch, CONFIGS[variant], monkeypatch)
