"""Libraries for fixed shapes beside a decoder's main library: prompts (`Prefill`) and one-token steps (`Decode`).

The main library keeps batch, sequence and past symbolic, so its GEMMs run over symbolic rows with a
per-row predicate in their inner loop (docs/tvm.md, *Decode and prefill*). Built for fixed rows, the
same program's products take whole register tiles (and a step's one row a one-row tile,
cpu_rules._one_row). `compile --prefill BxL` builds a library for prompts of batch B and up to L tokens
with an empty past; `compile --decode B` one for steps of batch B, one token, any past. The artifact
runs each call on the library that fits it (`choose`), else on the main library.

A prompt shorter than L is padded on the right (`Prefill.pad`) and the padding's rows cut off the
outputs (`Prefill.cut`). That is exact for a causal decoder: a prompt position attends to positions at
or before it, never to the padding. The padding's own rows attend to themselves (mask 1, the last
token repeated, positions counting on), so every value they leave in the cache is finite: a masked-out
NaN would still reach the prompt's rows through a zero weight. `verify` checks each library against
the main library before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import ClassVar

import numpy as np

from ...core.errors import ConfigError
from ...fx.decoder import INPUTS

SEQUENCE_AXIS = {"logits": 1}  # outputs cut along this axis; presents [batch, heads, length, head_dim] along 2
CACHE_AXIS = 2
VERIFY_PAST = 7  # the past a decode library's check steps after


@dataclass(frozen=True)
class Prefill:
    """A prefill library's shape: `batch` rows of up to `length` prompt tokens, past empty."""

    KEY: ClassVar[str] = "prefill"  # the manifest's list and the option's name
    batch: int
    length: int

    @property
    def library(self) -> str:
        return f"prefill-{self.batch}x{self.length}.so"

    @property
    def what(self) -> str:
        return f"prompts of batch {self.batch} and up to {self.length} tokens, empty past"

    def static_shapes(self, inputs: list[dict]) -> dict[str, tuple[int, ...]]:
        """The library's input dims from the main library's manifest `inputs` (name, shape, dtype): a
        past's heads and head size are the main library's (static), its length 0."""
        return {i["name"]: (self.batch, self.length) if i["name"] in INPUTS else (self.batch, *_heads(i, 0))
                for i in inputs}

    def fits(self, feeds: Mapping[str, np.ndarray]) -> bool:
        """Whether `feeds` (the decoder's inputs by name) are a prompt this library runs: its batch, no
        more tokens than its length, every past empty."""
        ids = feeds["input_ids"]
        return (ids.shape[0] == self.batch and 0 < ids.shape[1] <= self.length
                and all(np.shape(a)[CACHE_AXIS] == 0 for n, a in feeds.items() if n not in INPUTS))

    def pad(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`feeds` padded on the right to `length` tokens (the module docstring says with what and why)."""
        n = feeds["input_ids"].shape[1]
        extra = self.length - n
        out = dict(feeds)
        if extra:
            ids, positions = np.asarray(feeds["input_ids"]), np.asarray(feeds["position_ids"])
            out["input_ids"] = np.concatenate([ids, np.repeat(ids[:, -1:], extra, axis=1)], axis=1)
            out["attention_mask"] = np.concatenate(
                [feeds["attention_mask"], np.ones((self.batch, extra), np.asarray(feeds["attention_mask"]).dtype)], axis=1)
            out["position_ids"] = np.concatenate(
                [positions, positions[:, -1:] + np.arange(1, extra + 1, dtype=positions.dtype)], axis=1)
        return out

    def cut(self, outputs: Mapping[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
        """The outputs of a padded run for the first `n` prompt tokens: logits and presents cut to `n`."""
        cut = {}
        for name, array in outputs.items():
            index = [slice(None)] * array.ndim
            index[SEQUENCE_AXIS.get(name, CACHE_AXIS)] = slice(0, n)
            cut[name] = array[tuple(index)]
        return cut

    def check_feeds(self, inputs: list[dict], vocabulary: int) -> dict[str, np.ndarray]:
        """A prompt of three quarters of the length (so the padding is exercised), random token ids below
        `vocabulary`, empty pasts."""
        n = max(1, self.length * 3 // 4)
        dtypes = {i["name"]: i["dtype"] for i in inputs}
        return {**_prompt(self.batch, n, 0, vocabulary),
                **{name: np.zeros(dims, dtypes[name]) for name, dims in self.static_shapes(inputs).items()
                   if name not in INPUTS}}


@dataclass(frozen=True)
class Decode:
    """A decode library's shape: `batch` rows of one token each, any past."""

    KEY: ClassVar[str] = "decode"
    batch: int

    @property
    def library(self) -> str:
        return f"decode-{self.batch}.so"

    @property
    def what(self) -> str:
        return f"one-token steps of batch {self.batch}, any past"

    def static_shapes(self, inputs: list[dict]) -> dict[str, tuple[int, ...]]:
        """input_ids fixed at [batch, 1]; the dims it names are fixed wherever else they appear (the pasts'
        batch, the mask's `past + 1`), the past's length stays symbolic."""
        for past in inputs:
            if past["name"] not in INPUTS:
                _heads(past, 0)
        return {"input_ids": (self.batch, 1)}

    def fits(self, feeds: Mapping[str, np.ndarray]) -> bool:
        return feeds["input_ids"].shape == (self.batch, 1)

    def pad(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(feeds)

    def cut(self, outputs: Mapping[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
        del n
        return dict(outputs)

    def check_feeds(self, inputs: list[dict], vocabulary: int) -> dict[str, np.ndarray]:
        """One token after a random past of VERIFY_PAST positions."""
        rng = np.random.default_rng(1)
        pasts = {i["name"]: rng.standard_normal((self.batch, *_heads(i, VERIFY_PAST))).astype(i["dtype"])
                 for i in inputs if i["name"] not in INPUTS}
        return {**_prompt(self.batch, 1, VERIFY_PAST, vocabulary), **pasts}


KINDS = (Prefill, Decode)


def from_entry(kind: type, entry: dict) -> Prefill | Decode:
    """The shape a manifest entry of `kind`'s list records (its fields by name)."""
    return kind(*(entry[f.name] for f in fields(kind)))


def _heads(past: dict, length: int) -> tuple[int, int, int]:
    """(heads, length, head size) of a past input of the manifest (ConfigError unless heads and head size are static)."""
    dims = past["shape"]
    if not (dims and len(dims) == 4 and isinstance(dims[1], int) and isinstance(dims[3], int)):
        raise ConfigError(f"--prefill and --decode need pasts of static heads and head size; {past['name']} is {dims}")
    return dims[1], length, dims[3]


def _prompt(batch: int, n: int, past: int, vocabulary: int) -> dict[str, np.ndarray]:
    return {"input_ids": np.random.default_rng(0).integers(0, vocabulary, (batch, n), dtype=np.int64),
            "attention_mask": np.ones((batch, past + n), np.int64),
            "position_ids": np.repeat(np.arange(past, past + n, dtype=np.int64)[None], batch, axis=0)}


def parse(prefill: list[str] | None, decode: list[str] | None) -> tuple[list[tuple[int, int]], list[int]]:
    """(prefill pairs, decode batches) from `--prefill BATCHxLENGTH` and `--decode BATCH` (ConfigError naming a bad value)."""
    pairs = []
    for spec in prefill or []:
        batch, _, length = spec.partition("x")
        if not (batch.isdigit() and length.isdigit() and int(batch) > 0 and int(length) > 0):
            raise ConfigError(f"--prefill {spec!r} is not BATCHxLENGTH with both at least 1, e.g. 1x128")
        pairs.append((int(batch), int(length)))
    for spec in decode or []:
        if not (spec.isdigit() and int(spec) > 0):
            raise ConfigError(f"--decode {spec!r} is not a batch size of at least 1, e.g. 1")
    return pairs, [int(spec) for spec in decode or []]


def shapes(prefill: list | None, decode: list | None) -> list[Prefill | Decode]:
    """`compile_model`'s `prefill` ((batch, length) pairs) and `decode` (batch sizes) as distinct shapes
    (ConfigError on a value that is not positive ints)."""
    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v > 0

    out: list[Prefill | Decode] = []
    for pair in prefill or []:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(map(count, pair))):
            raise ConfigError(f"prefill takes (batch, length) pairs of positive ints, e.g. [(1, 128)]; got {pair!r}")
        out.append(Prefill(*pair))
    for batch in decode or []:
        if not count(batch):
            raise ConfigError(f"decode takes batch sizes, positive ints, e.g. [1]; got {batch!r}")
        out.append(Decode(batch))
    return list(dict.fromkeys(out))


def check_decoder(inputs: list[str], outputs: list[str]) -> None:
    """ConfigError unless the model is a decoder with past as `rewrite --with-past` writes it."""
    pasts, presents = inputs[len(INPUTS):], outputs[1:]
    if (tuple(inputs[:len(INPUTS)]) != INPUTS or outputs[:1] != ["logits"] or len(pasts) != len(presents)
            or not pasts or not all(p.startswith("past_key_values.") for p in pasts)
            or not all(p.startswith("present.") for p in presents)):
        raise ConfigError(f"--prefill and --decode apply to a decoder with past (rewrite --with-past: inputs "
                          f"{', '.join(INPUTS)}, past_key_values.*); this model's inputs are {inputs}")


def choose(shapes, feeds: Mapping[str, np.ndarray]):
    """The library that runs `feeds` (the shortest prefill that holds a prompt, else a decode library of
    its batch for a one-token step), or None (the main library runs them)."""
    fitting = [s for s in shapes if s.fits(feeds)]
    prompts = [s for s in fitting if isinstance(s, Prefill)]
    if prompts:
        return min(prompts, key=lambda s: s.length)
    return fitting[0] if fitting else None


def verify(shape: Prefill | Decode, main, library, device, inputs: list[dict], outputs: list[dict], tolerance) -> dict:
    """`library` (padded and cut as the artifact runs it) against the `main` executable on the shape's
    check feeds: {"reference", "tokens" (the prompt's, or 1 for a step), "past", "rows" (verify.compare rows)}."""
    from ...onnx.runtime import compare_outputs
    from .check import run

    vocabulary = outputs[0]["shape"][-1] if isinstance(outputs[0]["shape"][-1], int) else 2
    feeds = shape.check_feeds(inputs, vocabulary)
    names, outs = [i["name"] for i in inputs], [o["name"] for o in outputs]
    expected = dict(zip(outs, run(main, device, [feeds[n] for n in names])))
    padded = shape.pad(feeds)
    n = feeds["input_ids"].shape[1]
    actual = shape.cut(dict(zip(outs, run(library, device, [padded[name] for name in names]))), n)
    return {"reference": "the main library", "tokens": n, "past": feeds["attention_mask"].shape[1] - n,
            "rows": compare_outputs(expected, actual, tolerance)}
