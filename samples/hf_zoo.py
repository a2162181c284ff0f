"""More HF transformers architectures from tiny random configs, as `(model, example_inputs)` factories.

The zoo of tests/test_hf_zoo.py: encoder-decoders, vision transformers, convnets and decoder LMs
beyond samples/hf_models.py, each small enough (1-2 layers, width 16-64) to trace in seconds.
`ZOO` maps a short name to its factory. Text models take `use_cache=False` and an explicit
attention mask (torch.export then yields plain tensors); vision models take `pixel_values`.
"""

from __future__ import annotations

import torch
import transformers as tf

from .hf_models import _pixels, _text_inputs

VOCAB = 100


def _lm(config_cls, model_cls, **cfg):
    torch.manual_seed(0)
    base = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32)
    model = model_cls(config_cls(**{**base, **cfg})).eval()
    return model, {**_text_inputs(VOCAB), "use_cache": False}


def t5_factory():
    """T5 (pre-norm encoder-decoder): 2 encoder layers, 2 decoder layers."""
    torch.manual_seed(0)
    cfg = tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2,
                      num_heads=2, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    inputs = _text_inputs(VOCAB)
    dec = _text_inputs(VOCAB, length=6)
    return tf.T5ForConditionalGeneration(cfg).eval(), {
        **inputs, "decoder_input_ids": dec["input_ids"], "decoder_attention_mask": dec["attention_mask"], "use_cache": False}


def whisper_factory():
    """Whisper (pre-norm encoder-decoder with a conv front end): 2 encoder layers, 2 decoder layers."""
    torch.manual_seed(0)
    cfg = tf.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                           max_source_positions=8, max_target_positions=16, pad_token_id=0, bos_token_id=0,
                           eos_token_id=1, decoder_start_token_id=0)
    features = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    dec = _text_inputs(VOCAB, length=6)
    return tf.WhisperForConditionalGeneration(cfg).eval(), {
        "input_features": features, "decoder_input_ids": dec["input_ids"], "use_cache": False}


def swin_factory():
    """Swin: two stages of 2 blocks (window 4; the second block of a stage shifts its windows)."""
    torch.manual_seed(0)
    cfg = tf.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=4)
    return tf.SwinModel(cfg).eval(), _pixels(32)


def dinov2_factory():
    """Dinov2 (pre-norm ViT with layer scale: x + gamma * f(x))."""
    torch.manual_seed(0)
    cfg = tf.Dinov2Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, mlp_ratio=2, image_size=16,
                          patch_size=8)
    return tf.Dinov2Model(cfg).eval(), _pixels(16)


def deit_factory():
    """DeiT (pre-norm ViT with class and distillation tokens)."""
    torch.manual_seed(0)
    cfg = tf.DeiTConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                        image_size=16, patch_size=8)
    return tf.DeiTModel(cfg).eval(), _pixels(16)


def convnext_factory():
    """ConvNeXt: two stages of 2 blocks, x + gamma * pwconv(act(pwconv(LN(dwconv x)))) in NCHW."""
    torch.manual_seed(0)
    cfg = tf.ConvNextConfig(num_channels=3, patch_size=4, num_stages=2, hidden_sizes=[16, 32], depths=[2, 2], image_size=32)
    return tf.ConvNextModel(cfg).eval(), _pixels(32)


def mobilenetv2_factory(default_init: bool = False):
    """MobileNetV2 (linear-bottleneck inverted residuals, no activation after the add).

    HF's default init (truncated normal, std 0.02) shrinks the signal ~100x per block: its outputs
    are ~1e-20, too small to verify anything; unless `default_init`, convolutions get He init.
    """
    torch.manual_seed(0)
    cfg = tf.MobileNetV2Config(depth_multiplier=0.25, image_size=32, min_depth=8)
    model = tf.MobileNetV2Model(cfg).eval()
    if not default_init:
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.Conv2d):
                    torch.nn.init.kaiming_normal_(m.weight, generator=torch.Generator().manual_seed(0))
    return model, _pixels(32)


def mobilenetv2_default_init_factory():
    """MobileNetV2 at HF's default init: outputs ~1e-26, below what any verdict can judge."""
    return mobilenetv2_factory(default_init=True)


def phi_factory():
    """Phi (parallel attention + MLP per layer, GELU-tanh `gelu_new` activation)."""
    return _lm(tf.PhiConfig, tf.PhiForCausalLM, hidden_act="gelu_new")


def falcon_factory():
    """Falcon (parallel attention + MLP summed in place: `mlp_output += attention_output`)."""
    torch.manual_seed(0)
    cfg = tf.FalconConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=VOCAB,
                          parallel_attn=True, new_decoder_architecture=False, alibi=False, bias=False)
    return tf.FalconForCausalLM(cfg).eval(), {**_text_inputs(VOCAB), "use_cache": False}


def gpt_neox_factory():
    """GPT-NeoX / Pythia (parallel residual: x + attn(ln1 x) + mlp(ln2 x))."""
    torch.manual_seed(0)
    cfg = tf.GPTNeoXConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           vocab_size=VOCAB, max_position_embeddings=32, use_parallel_residual=True)
    return tf.GPTNeoXForCausalLM(cfg).eval(), {**_text_inputs(VOCAB), "use_cache": False}


def qwen2_factory():
    """Qwen2 (pre-norm decoder, grouped-query attention, RMSNorm)."""
    return _lm(tf.Qwen2Config, tf.Qwen2ForCausalLM, num_key_value_heads=1)


def gemma_factory():
    """Gemma (pre-norm decoder, RMSNorm with (1 + w), scaled embeddings, gelu-tanh MLP)."""
    return _lm(tf.GemmaConfig, tf.GemmaForCausalLM, head_dim=16, num_key_value_heads=1)


def mixtral_factory():
    """Mixtral (pre-norm decoder, sparse mixture of experts: 4 experts, top 2 per token)."""
    return _lm(tf.MixtralConfig, tf.MixtralForCausalLM, num_key_value_heads=1, num_local_experts=4,
               num_experts_per_tok=2)


def _ssm_lm(config_cls, model_cls, **cfg):
    """A state-space LM (no attention sizes in its config), with the text models' inputs."""
    torch.manual_seed(0)
    model = model_cls(config_cls(hidden_size=32, vocab_size=VOCAB, **cfg)).eval()
    return model, {**_text_inputs(VOCAB), "use_cache": False}


def mamba2_factory():
    """Mamba2: 2 pre-norm SSM layers; the chunked scan pads the sequence to whole chunks of 4 and
    slices it back, so the branch's length is an expression the export's guards equate to the skip's."""
    return _ssm_lm(tf.Mamba2Config, tf.Mamba2ForCausalLM, num_hidden_layers=2, state_size=8, num_heads=4,
                   head_dim=16, n_groups=1, chunk_size=4)


def zamba2_factory():
    """Zamba2: a hybrid layer (a shared attention block's projection added into the stream, then
    Mamba2) and a Mamba2 layer; chunked scans as in Mamba2."""
    return _ssm_lm(tf.Zamba2Config, tf.Zamba2ForCausalLM, num_hidden_layers=2, layers_block_type=["hybrid", "mamba"],
                   mamba_d_state=8, n_mamba_heads=4, mamba_headdim=16, mamba_ngroups=1, chunk_size=4,
                   num_attention_heads=2, attention_head_dim=16, intermediate_size=64, num_mem_blocks=1,
                   use_mem_rope=False, max_position_embeddings=32)


def falcon_mamba_factory():
    """FalconMamba: its selective scan loops over the sequence, which the export then fixes at 8."""
    return _ssm_lm(tf.FalconMambaConfig, tf.FalconMambaForCausalLM, num_hidden_layers=1, state_size=8, conv_kernel=4)


ZOO = {
    "t5": t5_factory,
    "whisper": whisper_factory,
    "swin": swin_factory,
    "dinov2": dinov2_factory,
    "deit": deit_factory,
    "convnext": convnext_factory,
    "mobilenetv2": mobilenetv2_factory,
    "phi": phi_factory,
    "falcon": falcon_factory,
    "gpt_neox": gpt_neox_factory,
    "qwen2": qwen2_factory,
    "gemma": gemma_factory,
    "mixtral": mixtral_factory,
}
