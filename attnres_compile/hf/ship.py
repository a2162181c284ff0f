"""What the deploy routes take from a converted model or a saved folder.

`load_folder(dir)` loads a saved folder without running its code: an AttnRes checkpoint through
`load`, a plain HF causal LM without trust_remote_code. `queries(source)` returns the AttnRes
config and pseudo-queries as {"chain<i>.site<k>": float32 array}, for `rewrite_onnx(..., queries=)`.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..core.errors import InputError
from ..utils.file_kind import folder_kind
from .checkpoint import SECTION, load


def load_folder(path: str | os.PathLike) -> tuple[torch.nn.Module, bool]:
    """(model in eval mode, whether it is an AttnRes checkpoint) of a saved folder; see the module docstring."""
    where = str(path)
    if folder_kind(path) == "attnres":
        return load(path).eval(), True
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"{where}: transformers cannot load it as a causal LM without running code from the folder "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]})") from None
    return model.eval(), False


def example_inputs(model: torch.nn.Module, batch: int = 2, length: int = 8) -> dict:
    """Token ids and a mask for tracing a causal LM (use_cache=False, as `rewrite` traces factories)."""
    vocab = int(getattr(model.config, "vocab_size", 100) or 100)
    ids = torch.randint(min(3, vocab - 1), min(vocab, 1000), (batch, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}


def queries(source) -> tuple[dict, dict[str, np.ndarray]]:
    """(AttnRes config fields, {"chain<i>.site<k>" (and Delta's "chain<i>.gate<k>"): float32 array}) of a converted model (`convert`,
    `load`) or of an AttnRes checkpoint folder."""
    if isinstance(source, (str, os.PathLike)):
        if not os.path.isdir(source):
            raise InputError(f"{source}: the queries come from an AttnRes checkpoint folder (save_pretrained of a "
                             "converted model); this is not a folder")
        if folder_kind(source) != "attnres":
            raise InputError(f"{source} is a Hugging Face checkpoint, not an AttnRes one (its config.json has no "
                             f"'{SECTION}' section): it has no trained queries")
        source = load(source)
    get_decoder = getattr(source, "get_decoder", None)
    backbone = get_decoder() if callable(get_decoder) else None
    state = getattr(backbone, "attnres_state", None)
    holder = getattr(backbone, "attnres", None)
    if state is None or holder is None:
        raise InputError(f"{type(source).__name__} is not a model converted by attnres_compile.convert (merge a PEFT "
                         "model first: merge_and_unload())")
    found = {}
    for chain, site, _ in state.sites:
        for kind in ("site", "gate"):  # a Delta AttnRes site's gate beside its query
            value = getattr(holder, chain).get(f"{kind}{site}")
            if value is not None:
                found[f"{chain}.{kind}{site}"] = value.detach().to(device="cpu", dtype=torch.float32).numpy().copy()
    return dict(state.config), found


def config_for(saved: dict, given, where: str):
    """The AttnResConfig to rewrite with beside `saved` (a checkpoint's config fields): `given` when
    it is the same or None; another one is refused in one line (the queries were trained for these
    sites)."""
    from ..core.checks import as_config
    from ..core.config import AttnResConfig
    from ..core.errors import ConfigError

    theirs = AttnResConfig(**saved)
    if given is None:
        return theirs
    ours = as_config(given)
    if ours != theirs:
        raise ConfigError(f"{where} was converted with {_words(theirs)}, not {_words(ours)}: its queries are for its "
                          "own sites (leave the AttnRes options out; the checkpoint's config is used)")
    return ours


def _words(config) -> str:
    return (f"variant={config.variant}" + (f" num_blocks={config.num_blocks}" if config.num_blocks else "")
            + (f" block_size={config.block_size}" if config.block_size else "") + f" scale={config.scale}"
            f" eps={config.eps:g}")
