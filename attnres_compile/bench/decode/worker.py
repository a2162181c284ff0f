"""Decode loops of saved decoder-with-past artifacts, checked then timed in a fresh worker (model_worker.Workers).

A candidate's call is the whole decode: from its own untimed prefill, `steps` one-token steps,
each fed the previous step's present, with the tokens fixed in advance (teacher forcing). It
returns the last-position logits of every step, [steps, vocab], checked before timing. Runtimes:
"eager" (a .pt2 on its lean copy), "hf" (HF's forward with a DynamicCache), "onnxruntime", "tvm"
(presents kept as TVM tensors) and "generate" (bench/decode/route.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..model.worker import _load_npz, compare, load_tvm, onnxruntime_options, set_threads

Decode = Callable[[], np.ndarray]


def _feeds(ids: np.ndarray, prefill: int, steps: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(input_ids, attention_mask, position_ids) of each decode step: token prefill + k at that position."""
    batch = ids.shape[0]
    return [(ids[:, prefill + k:prefill + k + 1], np.ones((batch, prefill + k + 1), np.int64),
             np.full((batch, 1), prefill + k, np.int64)) for k in range(steps)]


def _prompt(ids: np.ndarray, prefill: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    batch = ids.shape[0]
    return (ids[:, :prefill], np.ones((batch, prefill), np.int64),
            np.broadcast_to(np.arange(prefill, dtype=np.int64), (batch, prefill)).copy())


def _eager(path: str, ids: np.ndarray, job: dict) -> Decode:
    """The .pt2 decoder-with-past under no_grad, torch tensors from step to step, each step on the
    module's fx/lean.py copy where it fits (as `attnres-compile generate` runs a .pt2)."""
    import torch

    from ... import ops  # noqa: F401  (the program's attnres ops, before it is loaded)
    from ...fx import lean as fx_lean

    loaded = torch.export.load(path).module()
    lean = fx_lean.lean_copy(loaded)

    def module(*args):
        return fx_lean.call(lean, loaded, args)
    empty = [torch.zeros(ids.shape[0], h, 0, d) for h, d in zip(job["heads"], job["head_dims"]) for _ in range(2)]
    feeds = [tuple(map(torch.from_numpy, f)) for f in _feeds(ids, job["prefill"], job["steps"])]
    with torch.no_grad():
        first = module(*map(torch.from_numpy, _prompt(ids, job["prefill"])), *empty)
    past0 = [v for k, v in first.items() if k.startswith("present.")]

    def decode():
        past, logits = past0, []
        with torch.no_grad():
            for f in feeds:
                out = module(*f, *past)
                past = [v for k, v in out.items() if k.startswith("present.")]
                logits.append(out["logits"][:, -1])
        return torch.cat(logits).numpy()
    return decode


def _hf(ids: np.ndarray, job: dict) -> Decode:
    """The HF model's own forward, a DynamicCache holding the prefill's keys and values growing in place."""
    import torch

    from ...fx import decoder
    from .route import model_of

    model = model_of(job)
    cache_arg = decoder._cache_param(model)
    feeds = [tuple(map(torch.from_numpy, f)) for f in _feeds(ids, job["prefill"], job["steps"])]
    prompt, mask, pos = map(torch.from_numpy, _prompt(ids, job["prefill"]))
    with torch.no_grad():
        first = model(input_ids=prompt, attention_mask=mask, position_ids=pos, use_cache=True)
    cache = getattr(first, "cache", None) or first.past_key_values
    past0 = [t for layer in decoder._layers_of(cache) for t in (layer.keys, layer.values)]

    def decode():
        cache, logits = decoder.fresh_cache(past0), []  # updates make new tensors: past0 stays the prefill's
        with torch.no_grad():
            for tok, mask, pos in feeds:
                out = model(input_ids=tok, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_arg: cache})
                logits.append(out.logits[:, -1])
        return torch.cat(logits).numpy()
    return decode


def _onnxruntime(path: str, ids: np.ndarray, job: dict) -> Decode:
    """The decoder-with-past .onnx, numpy feeds by name (as generate_loop runs it)."""
    import onnxruntime as ort

    session = ort.InferenceSession(path, onnxruntime_options(job["threads"]), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    pasts = ["past_key_values." + n[len("present."):] for n in names[1:]]
    empty = {p: np.zeros((ids.shape[0], h, 0, d), np.float32)
             for p, (h, d) in zip(pasts, [(h, d) for h, d in zip(job["heads"], job["head_dims"]) for _ in range(2)])}
    feeds = _feeds(ids, job["prefill"], job["steps"])
    head = ("input_ids", "attention_mask", "position_ids")
    past0 = session.run(None, {**dict(zip(head, _prompt(ids, job["prefill"]))), **empty})[1:]

    def decode():
        past, logits = past0, []
        for f in feeds:
            out = session.run(None, {**dict(zip(head, f)), **dict(zip(pasts, past))})
            past = out[1:]
            logits.append(out[0][:, -1])
        return np.concatenate(logits)
    return decode


def _tvm(path: str, ids: np.ndarray, job: dict) -> Decode:
    """The library's main on TVM tensors: feeds converted before timing, presents kept as TVM tensors."""
    import tvm

    vm, dev = load_tvm(path, "cpu")
    main = vm["main"]
    head = [np.int64] * 3
    shapes = [(h, d) for h, d in zip(job["heads"], job["head_dims"]) for _ in range(2)]
    pasts = [np.float32] * len(shapes)

    def tensors(arrays, dtypes):
        return [tvm.runtime.tensor(np.ascontiguousarray(a.astype(t)), dev) for a, t in zip(arrays, dtypes)]

    empty = tensors([np.zeros((ids.shape[0], h, 0, d)) for h, d in shapes], pasts)
    feeds = [tensors(f, head) for f in _feeds(ids, job["prefill"], job["steps"])]
    past0 = list(main(*tensors(_prompt(ids, job["prefill"]), head), *empty))[1:]

    def decode():
        past, logits = past0, []
        for f in feeds:
            out = list(main(*f, *past))
            past = out[1:]
            logits.append(out[0].numpy()[:, -1])
        return np.concatenate(logits)
    return decode


def decoder_for(c: dict, ids: np.ndarray, job: dict) -> Decode:
    if c["runtime"] == "eager":
        return _eager(c["artifact"], ids, job)
    if c["runtime"] == "hf":
        return _hf(ids, job)
    if c["runtime"] == "onnxruntime":
        return _onnxruntime(c["artifact"], ids, job)
    if c["runtime"] == "tvm":
        return _tvm(c["artifact"], ids, job)
    if c["runtime"] == "generate":
        from .route import decoder

        return decoder(c["variant"], ids, job)
    raise ValueError(f"unknown decode runtime {c['runtime']!r}")


def time_decode(job: dict) -> dict:
    """Check then time job["candidates"] ([{name, runtime, artifact, check}]) at job["threads"], as
    model_worker.time_candidates does: `check` names the candidate whose step logits this one must
    match, or "reference" (job["reference"]: the torch model's logits at the decoded positions)."""
    from .. import timing

    set_threads(job["threads"])
    ids = _load_npz(job["inputs"])["input_ids"]
    reference = {"logits": _load_npz(job["reference"])["logits"]} if job.get("reference") else {}
    calls, outputs = {}, {}
    for c in job["candidates"]:
        calls[c["name"]] = decoder_for(c, ids, job)
        outputs[c["name"]] = {"logits": calls[c["name"]]()}
    checks = {c["name"]: compare(outputs[c["name"]], reference if c["check"] == "reference" else outputs[c["check"]])
              for c in job["candidates"]}
    samples = timing.interleaved_clocks(calls, job["rounds"], job["min_time"])
    return {"samples": samples, "checks": checks}
