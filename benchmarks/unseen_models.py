"""HF architectures the suite does not name, through the CLI: `rewrite` (Full) to .pt2 and .onnx,
then `compile` each, one line per model and route.

    python benchmarks/unseen_models.py [NAME ...] [--out FOLDER]

Tiny random configs (2-4 layers, width 16-32), built here and called as `unseen_models:NAME`
factories. Each line: the step that failed with its one-line error, or the compile's verification
line (the artifact against onnxruntime for .onnx, against torch for .pt2) and the kinds of its
site kernels (`_ln` / `_rms`: the next norm fused). A model the tool handles today is only a
starting point for the next one: add configs here when a user's model breaks.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers as tf

ROUTES = ("pt2", "onnx")


def _text(vocab: int) -> dict:
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}


def _encoder_text(vocab: int) -> dict:
    """_text without `use_cache`, for encoders that take no such argument."""
    return {k: v for k, v in _text(vocab).items() if k != "use_cache"}


def _audio(samples: int) -> dict:
    return {"input_values": torch.randn(2, samples, generator=torch.Generator().manual_seed(0))}


def _seq2seq(vocab: int) -> dict:
    """_text for the encoder, its first six tokens for the decoder."""
    text = _text(vocab)
    return {**text, "decoder_input_ids": text["input_ids"][:, :6], "decoder_attention_mask": text["attention_mask"][:, :6]}


def _pixels(size: int) -> dict:
    return {"pixel_values": torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))}


def _build(cls, cfg, inputs):
    torch.manual_seed(0)
    return cls(cfg).eval(), inputs


SEQ2SEQ = dict(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
               pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2)
LM = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=100, max_position_embeddings=32)
GQA = dict(LM, num_key_value_heads=1)
VISION = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, image_size=16, patch_size=8)

MODELS = {
    "gptj": lambda: _build(tf.GPTJForCausalLM, tf.GPTJConfig(n_layer=3, n_embd=32, n_head=2, rotary_dim=8,
                                                            vocab_size=100, n_positions=32), _text(100)),
    "gemma3": lambda: _build(tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(num_hidden_layers=3, head_dim=16,
                                                                       sliding_window=4, **GQA), _text(100)),
    "smollm3": lambda: _build(tf.SmolLM3ForCausalLM, tf.SmolLM3Config(num_hidden_layers=4, pad_token_id=0, **GQA),
                              _text(100)),
    "olmo": lambda: _build(tf.OlmoForCausalLM, tf.OlmoConfig(num_hidden_layers=3, **LM), _text(100)),
    "glm": lambda: _build(tf.GlmForCausalLM, tf.GlmConfig(num_hidden_layers=3, head_dim=16, pad_token_id=0, **GQA),
                          _text(100)),
    "helium": lambda: _build(tf.HeliumForCausalLM, tf.HeliumConfig(num_hidden_layers=3, head_dim=16, **GQA), _text(100)),
    "clip_vision": lambda: _build(tf.CLIPVisionModel, tf.CLIPVisionConfig(num_hidden_layers=3, **VISION), _pixels(16)),
    "dinov2_registers": lambda: _build(tf.Dinov2WithRegistersModel, tf.Dinov2WithRegistersConfig(
        num_hidden_layers=3, num_register_tokens=2, **VISION), _pixels(16)),
    "swinv2": lambda: _build(tf.Swinv2Model, tf.Swinv2Config(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2],
                                                            num_heads=[2, 2], window_size=4), _pixels(32)),
    "pvt_v2": lambda: _build(tf.PvtV2Model, tf.PvtV2Config(num_encoder_blocks=2, depths=[2, 2], hidden_sizes=[16, 32],
                                                          num_attention_heads=[1, 2], sr_ratios=[2, 1],
                                                          patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2]),
                             _pixels(32)),
    "mixtral": lambda: _build(tf.MixtralForCausalLM, tf.MixtralConfig(num_hidden_layers=2, num_local_experts=4,
                                                                       num_experts_per_tok=2, **GQA), _text(100)),
    "qwen3_moe": lambda: _build(tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
        num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16, **GQA),
        _text(100)),
    "deepseek_v3": lambda: _build(tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(
        num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        moe_intermediate_size=32, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, **LM), _text(100)),
    "mamba": lambda: _build(tf.MambaForCausalLM, tf.MambaConfig(num_hidden_layers=3, hidden_size=32, state_size=8,
                                                                 vocab_size=100, conv_kernel=4), _text(100)),
    "modernbert": lambda: _build(tf.ModernBertModel, tf.ModernBertConfig(
        num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=100,
        global_attn_every_n_layers=2, local_attention=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        cls_token_id=1, sep_token_id=2), _encoder_text(100)),
    "bloom": lambda: _build(tf.BloomForCausalLM, tf.BloomConfig(n_layer=3, hidden_size=32, n_head=2, vocab_size=100),
                            _text(100)),
    "cohere": lambda: _build(tf.CohereForCausalLM, tf.CohereConfig(num_hidden_layers=3, pad_token_id=0, bos_token_id=1,
                                                                   eos_token_id=2, **GQA), _text(100)),
    "segformer": lambda: _build(tf.SegformerModel, tf.SegformerConfig(
        num_encoder_blocks=2, depths=[2, 2], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2],
        patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2]), _pixels(32)),
    "beit": lambda: _build(tf.BeitModel, tf.BeitConfig(num_hidden_layers=3, use_relative_position_bias=True,
                                                       layer_scale_init_value=0.1, **VISION), _pixels(16)),
    "qwen3": lambda: _build(tf.Qwen3ForCausalLM, tf.Qwen3Config(num_hidden_layers=3, head_dim=16, **GQA), _text(100)),
    "lfm2": lambda: _build(tf.Lfm2ForCausalLM, tf.Lfm2Config(
        num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2, **GQA), _text(100)),
    "jamba": lambda: _build(tf.JambaForCausalLM, tf.JambaConfig(
        num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_dt_rank=4, **GQA), _text(100)),
    "granitemoe": lambda: _build(tf.GraniteMoeForCausalLM, tf.GraniteMoeConfig(
        num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, **GQA), _text(100)),
    "wav2vec2": lambda: _build(tf.Wav2Vec2Model, tf.Wav2Vec2Config(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        do_stable_layer_norm=True), _audio(400)),
    "hiera": lambda: _build(tf.HieraModel, tf.HieraConfig(
        embed_dim=16, image_size=[64, 64], patch_size=[7, 7], patch_stride=[4, 4], patch_padding=[3, 3], depths=[1, 2],
        num_heads=[1, 2], query_stride=[2, 2], masked_unit_size=[4, 4], num_query_pool=1), _pixels(64)),
    "bart": lambda: _build(tf.BartForConditionalGeneration, tf.BartConfig(**SEQ2SEQ), _seq2seq(100)),
    "mbart": lambda: _build(tf.MBartForConditionalGeneration, tf.MBartConfig(**SEQ2SEQ), _seq2seq(100)),
    "clip_text": lambda: _build(tf.CLIPTextModel, tf.CLIPTextConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=100,
        max_position_embeddings=32, bos_token_id=1, eos_token_id=2), _encoder_text(100)),
    "xlm_roberta_xl": lambda: _build(tf.XLMRobertaXLModel, tf.XLMRobertaXLConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=100,
        max_position_embeddings=40), _encoder_text(100)),
    "hubert": lambda: _build(tf.HubertModel, tf.HubertConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        do_stable_layer_norm=True), _audio(400)),
    "siglip_vision": lambda: _build(tf.SiglipVisionModel, tf.SiglipVisionConfig(num_hidden_layers=3, **VISION),
                                    _pixels(16)),
    "olmo2": lambda: _build(tf.Olmo2ForCausalLM, tf.Olmo2Config(num_hidden_layers=3, pad_token_id=0, eos_token_id=2,
                                                                **LM), _text(100)),
}
globals().update({name: make for name, make in MODELS.items()})  # `unseen_models:NAME` factories for the CLI


def _cli(*args: str) -> tuple[int, str]:
    paths = [str(Path(__file__).parent), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}  # no empty entry: it would put the cwd first
    done = subprocess.run([sys.executable, "-m", "attnres_compile.cli", *args], capture_output=True, text=True, env=env)
    return done.returncode, done.stdout + done.stderr


def run(name: str, route: str, folder: Path) -> dict:
    """One model through `rewrite -o NAME.ROUTE` and `compile`: a row with the outcome."""
    model = folder / f"{name}.{route}"
    code, text = _cli("rewrite", f"unseen_models:{name}", "-o", str(model), "--force")
    if code:
        return {"model": name, "route": route, "failed": "rewrite", "line": text.strip().splitlines()[-1]}
    code, text = _cli("compile", str(model), "-o", str(folder / f"{name}_{route}"), "--force")
    if code:
        return {"model": name, "route": route, "failed": "compile", "line": text.strip().splitlines()[-1]}
    sites = json.loads((folder / f"{name}_{route}" / "manifest.json").read_text())["sites"]
    kinds = collections.Counter(s["kernel"].rsplit("_", 1)[-1] if s["kernel"].endswith(("_ln", "_rms")) else "unfused"
                                for s in sites)
    checks = [" ".join(line.split()) for line in text.splitlines() if line.strip()[:1] in ("✓", "✗", "?")]
    return {"model": name, "route": route, "sites": len(sites), "kernels": dict(kinds), "verified": checks}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"default: all of {', '.join(MODELS)}")
    parser.add_argument("--out", type=Path, help="keep the files here (default: a temporary folder)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.out or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for name in args.names or MODELS:
            for route in ROUTES:
                row = run(name, route, folder)
                outcome = (f"{row['failed']} failed: {row['line']}" if "failed" in row
                           else f"{row['sites']} sites {row['kernels']}; {' | '.join(row['verified'])}")
                print(f"{name:>18} {route:>4}: {outcome}", flush=True)


if __name__ == "__main__":
    main()
