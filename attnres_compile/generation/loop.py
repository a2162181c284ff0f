"""Greedy decoding over a decoder-with-past step: one loop for torch, onnxruntime and TVM.
A step maps feeds by name (fx/decoder.py's) to outputs by name. The prompt is one prefill with an
empty past; each new token is one step fed the previous present. Prompts of different lengths
are left-padded (`left_pad`); positions and stopping follow HF `generate()`, so tokens compare one
for one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from ..fx.decoder import positions

Step = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass
class Generated:
    """`tokens` [batch, prompt_length + steps]: the (left-padded) prompt and what followed, finished
    rows padded, HF generate()'s layout; `new_tokens`: each row's generated ids, through its
    end-of-sequence id where it stopped (`stopped`); wall seconds of the prefill step and of all
    decode steps."""

    tokens: np.ndarray
    prompt_length: int
    new_tokens: list[list[int]]
    stopped: list[bool]
    prefill_s: float
    decode_s: float

    @property
    def decode_steps(self) -> int:
        """Steps after the prefill (each gives one token per row)."""
        return self.tokens.shape[1] - self.prompt_length - 1

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second of the decode steps, over the whole batch (finished rows still compute)."""
        steps = self.decode_steps
        return steps * self.tokens.shape[0] / self.decode_s if steps > 0 and self.decode_s > 0 else float("nan")


def past_name(present: str) -> str:
    """`present.3.key` -> `past_key_values.3.key`."""
    return "past_key_values." + present[len("present."):]


def left_pad(rows: Sequence[Sequence[int]], pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, attention_mask), int64 [batch, longest]: shorter rows padded on the left, mask 0 there."""
    length = max(len(r) for r in rows)
    ids = np.full((len(rows), length), pad_token_id, dtype=np.int64)
    mask = np.zeros((len(rows), length), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, length - len(row):] = row
        mask[i, length - len(row):] = 1
    return ids, mask


def _positions(mask: np.ndarray, length: int) -> np.ndarray:
    return positions(torch.from_numpy(mask), length).numpy()


def _prefill_feeds(prompt: np.ndarray, mask: np.ndarray, empty_past: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"input_ids": prompt, "attention_mask": mask, "position_ids": _positions(mask, prompt.shape[1]), **empty_past}


def _decode_feeds(token: np.ndarray, mask: np.ndarray, out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"input_ids": token[:, None], "attention_mask": mask, "position_ids": _positions(mask, 1),
            **{past_name(k): v for k, v in out.items() if k.startswith("present.")}}


def _inputs(prompt, attention_mask) -> tuple[np.ndarray, np.ndarray]:
    prompt = np.asarray(prompt, dtype=np.int64)
    mask = np.ones(prompt.shape, dtype=np.int64) if attention_mask is None else np.asarray(attention_mask, dtype=np.int64)
    return prompt, mask


def warm_up(step: Step, prompt: np.ndarray, empty_past: dict[str, np.ndarray],
            attention_mask: np.ndarray | None = None) -> float:
    """Wall seconds of one untimed prefill and decode step on the prompt's shapes: a runtime's first
    calls build kernels (the op's fused kernels on a cold cache: minutes), plan memory and load
    code, which is set-up, not speed; `greedy` after it times the model alone."""
    prompt, mask = _inputs(prompt, attention_mask)
    start = time.perf_counter()
    out = step(_prefill_feeds(prompt, mask, empty_past))
    token = np.asarray(out["logits"])[:, -1].argmax(-1).astype(np.int64)
    step(_decode_feeds(token, np.concatenate([mask, np.ones_like(mask[:, :1])], axis=1), out))
    return time.perf_counter() - start


def greedy(step: Step, prompt: np.ndarray, empty_past: dict[str, np.ndarray], max_new_tokens: int,
           eos_token_id: int | Sequence[int] | None = None, attention_mask: np.ndarray | None = None,
           pad_token_id: int | None = None) -> Generated:
    """Greedy tokens after `prompt` ([batch, length] int64, left-padded where `attention_mask` has 0s).
    `empty_past`: every past input at length 0. A row stops at any of `eos_token_id` and is then
    padded with `pad_token_id` (default: the first eos id); the loop ends when all rows stopped.
    """
    prompt, mask = _inputs(prompt, attention_mask)
    batch, length = prompt.shape
    eos = np.array([] if eos_token_id is None else np.atleast_1d(eos_token_id), dtype=np.int64)
    pad = int(eos[0]) if pad_token_id is None and eos.size else pad_token_id
    start = time.perf_counter()
    out = step(_prefill_feeds(prompt, mask, empty_past))
    prefill = time.perf_counter() - start
    tokens, done = [prompt], np.zeros(batch, dtype=bool)
    new: list[list[int]] = [[] for _ in range(batch)]
    start = time.perf_counter()
    for n in range(max_new_tokens):
        token = np.asarray(out["logits"])[:, -1].argmax(-1).astype(np.int64)
        if eos.size:
            token = np.where(done, pad, token)
        for i in np.flatnonzero(~done):
            new[i].append(int(token[i]))
        done |= np.isin(token, eos) & ~done
        tokens.append(token[:, None])
        if n == max_new_tokens - 1 or done.all():
            break
        mask = np.concatenate([mask, np.ones((batch, 1), dtype=np.int64)], axis=1)
        out = step(_decode_feeds(token, mask, out))
    decode = time.perf_counter() - start
    return Generated(np.concatenate(tokens, axis=1), length, new, done.tolist(), prefill, decode)
