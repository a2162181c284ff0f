"""onnxruntime-genai folders (genai_config.json, the decoder .onnx, tokenizer files) run by og.Generator.

`generate` runs such a folder as it is deployed, with og.Model and og.Generator (greedy): genai's
decoder inputs are not all described by its config, so a loop of our own would be a guessed
reimplementation. Prompts of different lengths are right-padded with pad_token_id (left padding
changes the shorter rows' tokens). og stops a row at eos_token_id without keeping that id, so a
genai row's `new_tokens` end before it where HF generate() keeps it; `stopped` says which rows
stopped.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..core.errors import ConfigError, InputError, first_line
from ..fx.decoder import token_ids
from ..generation.loop import Generated
from ..onnx.genai import CONFIG as GENAI_CONFIG
from ..onnx.genai import is_genai_folder, read_config
from ..utils import progress

__all__ = ["GENAI_CONFIG", "generate", "ids", "is_genai_folder"]


def ids(config: dict) -> dict:
    """A checked genai config's end-of-sequence ids and pad id (none where it names none)."""
    found = token_ids(config.get("model"))
    return found or {"eos_token_id": [], "pad_token_id": None}


INT32_MAX = 2**31 - 1


def _check_ids(folder: Path, config: dict, rows: list[list[int]], pad: int, length: int) -> None:
    """og takes int32 token ids and a max_length within the model's context: a prompt id or length
    beyond them is a bad argument (ConfigError), a config id beyond int32 bad input (InputError)."""
    big = max(max(r) for r in rows)
    if big > INT32_MAX:
        raise ConfigError(f"--prompt-ids: token id {big} does not fit onnxruntime-genai's int32 token ids "
                          f"(at most {INT32_MAX})")
    if pad > INT32_MAX:
        raise InputError(f"{folder / GENAI_CONFIG}: pad_token_id {pad} does not fit onnxruntime-genai's int32 "
                         "token ids")
    context = config["model"].get("context_length")
    if type(context) is int and context > 0 and length > context:
        raise ConfigError(f"the prompt ({max(len(r) for r in rows)} tokens) plus --max-new-tokens "
                          f"({length - max(len(r) for r in rows)}) exceeds the folder's context length of {context}: "
                          "generate fewer tokens")


def generate(folder: Path, rows: list[list[int]], max_new_tokens: int,
             ignore_eos: bool = False) -> tuple[Generated, float, list[int], int]:
    """(Generated, warm-up seconds, eos ids, the pad id used): og.Generator's greedy tokens after each
    row, in og's layout (right-padded prompt, then new tokens); warm-up is one untimed 1-token run.
    """
    config = read_config(folder)  # data only, checked before og.Model sees it (onnx/genai.py)
    try:
        import onnxruntime_genai as og
    except ImportError:
        raise ConfigError(f"{folder} is an onnxruntime-genai folder: pip install onnxruntime-genai to run it") from None
    found = ids(config)
    pad = found["pad_token_id"] if found["pad_token_id"] is not None else (found["eos_token_id"] or [0])[0]
    width = max(len(r) for r in rows)
    _check_ids(folder, config, rows, pad, width + max_new_tokens)
    prompt = np.array([r + [pad] * (width - len(r)) for r in rows], dtype=np.int32)
    try:
        model = og.Model(str(folder))
    except Exception as exc:  # noqa: BLE001 - genai's own refusal (config, files, providers)
        raise InputError(f"{folder}: onnxruntime-genai cannot load it ({first_line(exc)})") from None

    def run(new: int) -> tuple[np.ndarray, list[int], float, float]:
        params = og.GeneratorParams(model)
        options = {"max_length": width + new, "do_sample": False, "batch_size": len(rows)}
        params.set_search_options(**options, **({"min_length": width + new} if ignore_eos else {}))
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens(prompt)  # the prompt's forward: the prefill
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        while not generator.is_done():
            generator.generate_next_token()
        decode = time.perf_counter() - start
        sequences = [np.asarray(generator.get_sequence(i), dtype=np.int64) for i in range(len(rows))]
        tokens = np.full((len(rows), max(len(s) for s in sequences)), pad, dtype=np.int64)
        for i, sequence in enumerate(sequences):
            tokens[i, :len(sequence)] = sequence
        return tokens, [len(s) for s in sequences], prefill, decode

    try:
        with progress.stage("warming up og.Generator"):
            start = time.perf_counter()
            run(1)
            warmup = time.perf_counter() - start
        tokens, lengths, prefill, decode = run(max_new_tokens)
    except Exception as exc:  # noqa: BLE001 - genai's own failure, in one line
        raise InputError(f"{folder}: og.Generator failed ({first_line(exc)})") from None
    eos = [] if ignore_eos else found["eos_token_id"]
    new, stopped = [], []
    for length, row in zip(lengths, tokens[:, width:].tolist()):
        row = row[:length - width]
        cut = next((i for i, t in enumerate(row) if t in eos), None)  # a finished row of a batch: padded from there
        new.append(row if cut is None else row[:cut])
        stopped.append(cut is not None or length < width + max_new_tokens)
    return Generated(tokens, width, new, stopped, prefill, decode), warmup, eos, pad
