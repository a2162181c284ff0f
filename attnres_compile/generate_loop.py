"""Greedy decoding over a decoder-with-past step: one loop for torch, onnxruntime and TVM.

A step maps feeds by name (decoder.py's names: `input_ids`, `attention_mask`, `position_ids`,
`past_key_values.{i}.key|value`) to outputs by name (`logits`, `present.{i}.key|value`). The
prompt is one prefill step with an empty past; each new token is one step whose past is the
previous step's present.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

Step = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass
class Generated:
    """`tokens` [batch, prompt + new]; wall seconds of the prefill step and of all decode steps."""

    tokens: np.ndarray
    new_tokens: int
    prefill_s: float
    decode_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens after the first per second of decode steps, over the whole batch."""
        steps = self.new_tokens - 1
        return steps * self.tokens.shape[0] / self.decode_s if steps > 0 and self.decode_s > 0 else float("nan")


def past_name(present: str) -> str:
    """`present.3.key` -> `past_key_values.3.key`."""
    return "past_key_values." + present[len("present."):]


def greedy(step: Step, prompt: np.ndarray, empty_past: dict[str, np.ndarray], max_new_tokens: int,
           eos_token_id: int | None = None) -> Generated:
    """Greedy tokens after `prompt` ([batch, length] int64): argmax of the last logits, one token a step.

    `empty_past`: every past input with length 0 (the prefill's). Stops early when every row has
    produced `eos_token_id`; finished rows then repeat it, as HF generate pads them.
    """
    prompt = np.asarray(prompt, dtype=np.int64)
    batch, length = prompt.shape
    mask = np.ones((batch, length), dtype=np.int64)
    feeds = {"input_ids": prompt, "attention_mask": mask,
             "position_ids": np.broadcast_to(np.arange(length, dtype=np.int64), (batch, length)).copy(), **empty_past}
    start = time.perf_counter()
    out = step(feeds)
    prefill = time.perf_counter() - start
    tokens, done = [prompt], np.zeros(batch, dtype=bool)
    start = time.perf_counter()
    for n in range(max_new_tokens):
        token = np.asarray(out["logits"])[:, -1].argmax(-1).astype(np.int64)
        if eos_token_id is not None:
            token = np.where(done, eos_token_id, token)
            done |= token == eos_token_id
        tokens.append(token[:, None])
        if n == max_new_tokens - 1 or done.all():
            break
        mask = np.concatenate([mask, np.ones((batch, 1), dtype=np.int64)], axis=1)
        feeds = {"input_ids": token[:, None], "attention_mask": mask, "position_ids": np.full((batch, 1), mask.shape[1] - 1),
                 **{past_name(k): v for k, v in out.items() if k.startswith("present.")}}
        out = step(feeds)
    decode = time.perf_counter() - start
    result = np.concatenate(tokens, axis=1)
    return Generated(result, result.shape[1] - length, prefill, decode)
