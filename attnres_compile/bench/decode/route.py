"""`bench decode --runtimes generate`: what the README's generation route costs per token.

The route is HF `generate()` on `generation.causal_lm(model, graph_module)`, the graph module from
`rewrite(model, None, config, with_past=True)`. Its candidates, each built afresh in the timing
worker from the same config and seed (or the same `--factory`): `original`, the model's own
`generate()` (the baseline); `copy`, an identical second model (the noise floor); `traced`,
causal_lm over the model's traced decoder with past, not rewritten (what the route costs before any
AttnRes); `block`, causal_lm over the Block (N=--blocks) rewrite. A call is one greedy `generate()`
of --prefill prompt tokens then --steps new ones (min_new_tokens: an end-of-sequence token does not
cut it short), the prefill included: the per-token time is the call's over --steps. Every
candidate's step logits are checked against `original`'s (the same tokens, else they differ).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

VARIANTS = ("original", "copy", "traced", "block")
BASE = "generate original"


def candidates() -> list[dict]:
    """The timing worker's candidates of the route (decode_worker.time_decode), checked against BASE."""
    return [{"name": f"generate {v}", "runtime": "generate", "variant": v, "check": BASE} for v in VARIANTS]


def model_of(job: dict):
    """The job's HF causal LM: the --factory's, or bench model's random config (seed 0) for
    job["model"], job["layers"] and job["width"]."""
    if job.get("factory"):
        from .. import factory

        return factory.load(job["factory"], isolated=False)  # a timing worker: its own time limit
    from ..model.measure import make_model

    return make_model(job["model"], job["layers"], job["width"], job["prefill"] + job["steps"]).model


def decoder(variant: str, ids: np.ndarray, job: dict) -> Callable[[], np.ndarray]:
    """One candidate's call: greedy generate() of job["steps"] tokens after ids[:, :prefill]; returns
    the logits of every step, [steps, vocab] (batch 1)."""
    import torch

    from ... import rewrite
    from ...core.config import AttnResConfig
    from ...fx import decoder as decoders
    from ...fx.trace import trace
    from ...generation.serve import causal_lm

    model = model_of(job)
    if variant == "traced":
        wrapper, args, spec = decoders.wrap(model)
        model = causal_lm(model, trace(wrapper, args, spec).graph_module)
    elif variant == "block":
        config = AttnResConfig(variant="block", num_blocks=job["blocks"])
        model = causal_lm(model, rewrite(model, None, config, with_past=True).graph_module)
    prompt = torch.from_numpy(np.ascontiguousarray(ids[:1, :job["prefill"]]))
    mask, steps = torch.ones_like(prompt), job["steps"]

    def decode() -> np.ndarray:
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True)
        return torch.cat(out.logits).numpy()
    return decode
