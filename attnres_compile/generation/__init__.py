"""Generation with a rewritten decoder-with-past: `causal_lm` serves it to HF `generate()`
(serve.py), `greedy` decodes on any runtime's step (loop.py)."""

from .serve import causal_lm

__all__ = ["causal_lm"]
