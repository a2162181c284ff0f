"""`bench decode --runtimes generate`: what the README's generation route costs per token.

The route is HF `generate()` on `generation.causal_lm(model, graph_module)`. Candidates, built
afresh in the worker: `original` (the model's own generate()), `copy` (noise floor), `traced`
(the route over the unrewritten decoder) and `block` (over the Block rewrite). A call is one
greedy generate() of --prefill then --steps tokens (min_new_tokens set); every candidate's step
logits are checked against `original`'s.
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
