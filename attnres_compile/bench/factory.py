"""A user's own causal LM in `bench model` and `bench decode` (`--factory module:function`).
The factory must give an HF causal LM (`input_ids`/`attention_mask` in, `.logits` out) whose
config names `hidden_size` and `num_hidden_layers`; it is timed at its own size.
"""

from __future__ import annotations

import torch

from ..core.errors import ConfigError

TIMEOUT = 600.0  # seconds a factory may take (--factory-timeout): loading a model from disk takes seconds


def load(spec: str, timeout: float | None = None, isolated: bool = True) -> torch.nn.Module:
    """The factory's model in eval mode, checked to be an HF causal LM with the config fields the
    benchmarks read (ConfigError otherwise). The factory is user code, so it runs in a forked child
    with time and memory limits (utils/isolate.py) unless `isolated=False` (timing workers)."""
    if not isolated:
        return _load(spec)
    from ..core.errors import InputError
    from ..utils import isolate

    seconds = TIMEOUT if timeout is None else timeout
    try:
        return isolate.run(_load, spec, what=f"--factory {spec}", action="loading the model", timeout=seconds,
                           hint="--factory-timeout sets the time limit")
    except isolate.ChildError as exc:  # not an AttnResError: a model that cannot be pickled back, say
        raise InputError(str(exc)) from None


def _load(spec: str) -> torch.nn.Module:
    from ..utils.factory import load_factory

    model, _ = load_factory(spec)
    config = getattr(model, "config", None)
    missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if not hasattr(config, k)]
    if not isinstance(model, torch.nn.Module) or missing:
        raise ConfigError(f"--factory {spec}: the benchmarks time an HF causal LM (a transformers model whose config "
                          f"has hidden_size, num_hidden_layers and vocab_size); this one has no "
                          f"{', '.join(missing) or 'torch module'}: time it with `rewrite --verify` or your own loop")
    return model.eval()


def geometry(spec: str, model: torch.nn.Module) -> tuple[str, int, int]:
    """(model name, width, sublayers) of a factory's model: the factory module's last name, the
    config's hidden size and twice its layers."""
    config = model.config
    return spec.split(":")[0].rsplit(".", 1)[-1], int(config.hidden_size), 2 * int(config.num_hidden_layers)


def vocab(model: torch.nn.Module, limit: int) -> int:
    """How many token ids the benchmarks draw from: the model's vocabulary, at most `limit` (the
    random models' own, so a factory's run feeds the same ids where its vocabulary allows)."""
    return min(int(model.config.vocab_size), limit)
