"""Tiny HF causal LMs from random configs for generation with a KV cache (`rewrite --with-past`).

Each factory returns `(model, example_inputs)` like samples/hf_models.py, with room for 64+ new
tokens (128 positions) and no end-of-sequence token, so greedy generation always runs its full
length and token-for-token comparisons cover every step.
"""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 100
BASE = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=VOCAB, max_position_embeddings=128)


def decoder(config_cls, model_cls, **cfg):
    """(model, example inputs) of `model_cls` from BASE updated with `cfg`, with no end-of-sequence token."""
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**BASE, **cfg})).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def llama_factory():
    """Llama: RMSNorm PreNorm, rotary positions, grouped-query attention (2 query heads, 1 KV head)."""
    return decoder(tf.LlamaConfig, tf.LlamaForCausalLM)


def qwen2_factory():
    """Qwen2: Llama-like with biased q/k/v projections."""
    return decoder(tf.Qwen2Config, tf.Qwen2ForCausalLM)


def mistral_factory():
    """Mistral with a sliding window of 8 tokens (shorter than a 12-token prompt plus 64 new ones)."""
    return decoder(tf.MistralConfig, tf.MistralForCausalLM, sliding_window=8)


def mixtral_factory():
    """Mixtral: sparse MoE MLPs (4 experts, top 2)."""
    return decoder(tf.MixtralConfig, tf.MixtralForCausalLM, num_local_experts=4, num_experts_per_tok=2)


def gpt2_factory():
    """GPT-2: LayerNorm PreNorm, learned positions, fused qkv (Conv1D)."""
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=128)
    model = tf.GPT2LMHeadModel(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


DECODERS = {"llama": llama_factory, "qwen2": qwen2_factory, "mistral": mistral_factory, "mixtral": mixtral_factory,
            "gpt2": gpt2_factory}
