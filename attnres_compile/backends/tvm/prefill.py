"""Prefill libraries: a decoder with past built again for one batch size and prompt length, past empty.

The main library keeps batch, sequence and past symbolic, so its GEMMs run over symbolic rows with a
per-row predicate in their inner loop (docs/tvm.md, *Decode and prefill*). Built for a fixed shape, the
same program's GEMMs take whole register tiles and its attention scores a GEMM. `compile --prefill BxL`
builds one such library per shape beside the main one (`compile_model(prefill=...)`); the artifact then
runs a prompt of batch B and n <= L tokens with an empty past on the shortest such L, padded on the right
(`Shape.pad`), and cuts the padding's rows off its outputs (`Shape.cut`).

Padding on the right is exact for a causal decoder: a prompt position attends to positions at or before
it, never to the padding. The padding's own rows attend to themselves (mask 1, the last token repeated,
positions counting on), so every value they leave in the cache is finite: a masked-out NaN would still
reach the prompt's rows through a zero weight. `verify` checks the padded route against the main
library before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ...core.errors import ConfigError
from ...fx.decoder import INPUTS

SEQUENCE_AXIS = {"logits": 1}  # outputs cut along this axis; presents [batch, heads, length, head_dim] along 2
CACHE_AXIS = 2


@dataclass(frozen=True)
class Shape:
    """A prefill library's shape: `batch` rows of up to `length` prompt tokens, past empty."""

    batch: int
    length: int

    @property
    def library(self) -> str:
        return f"prefill-{self.batch}x{self.length}.so"

    def static_shapes(self, inputs: list[dict]) -> dict[str, tuple[int, ...]]:
        """The library's input dims from the main library's manifest `inputs` (name, shape, dtype): a
        past's heads and head size are the main library's (static), its length 0."""
        shapes = {}
        for name, dims in ((i["name"], i["shape"]) for i in inputs):
            if name in INPUTS:
                shapes[name] = (self.batch, self.length)
            elif not (dims and len(dims) == 4 and isinstance(dims[1], int) and isinstance(dims[3], int)):
                raise ConfigError(f"--prefill needs a past of static heads and head size; {name} is {dims}")
            else:
                shapes[name] = (self.batch, dims[1], 0, dims[3])
        return shapes

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


def parse(specs: list[str] | None) -> list[tuple[int, int]]:
    """(batch, length) from `--prefill` values, `1x128` each (ConfigError naming the bad one)."""
    shapes = []
    for spec in specs or []:
        batch, _, length = spec.partition("x")
        if not (batch.isdigit() and length.isdigit() and int(batch) > 0 and int(length) > 0):
            raise ConfigError(f"--prefill {spec!r} is not BATCHxLENGTH with both at least 1, e.g. 1x128")
        shapes.append((int(batch), int(length)))
    return shapes


def shapes(given: list[tuple[int, int]] | None) -> list[Shape]:
    """`compile_model`'s `prefill`, (batch, length) pairs (or Shapes), as distinct Shapes (ConfigError on a bad one)."""
    out: list[Shape] = []
    for pair in given or []:
        fields = ((pair.batch, pair.length) if isinstance(pair, Shape)
                  else tuple(pair) if isinstance(pair, (tuple, list)) else ())
        if len(fields) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in fields):
            raise ConfigError(f"prefill takes (batch, length) pairs of positive ints, e.g. [(1, 128)]; got {pair!r}")
        if Shape(*fields) not in out:
            out.append(Shape(*fields))
    return out


def check_decoder(inputs: list[str], outputs: list[str]) -> None:
    """ConfigError unless the model is a decoder with past as `rewrite --with-past` writes it."""
    pasts, presents = inputs[len(INPUTS):], outputs[1:]
    if (tuple(inputs[:len(INPUTS)]) != INPUTS or outputs[:1] != ["logits"] or len(pasts) != len(presents)
            or not pasts or not all(p.startswith("past_key_values.") for p in pasts)
            or not all(p.startswith("present.") for p in presents)):
        raise ConfigError(f"--prefill applies to a decoder with past (rewrite --with-past: inputs {', '.join(INPUTS)}, "
                          f"past_key_values.*); this model's inputs are {inputs}")


def choose(shapes: list[Shape], feeds: Mapping[str, np.ndarray]) -> Shape | None:
    """The shortest prefill library that runs `feeds`, or None (the main library runs them)."""
    fitting = [s for s in shapes if s.fits(feeds)]
    return min(fitting, key=lambda s: s.length) if fitting else None


def verification_feeds(shape: Shape, inputs: list[dict], vocabulary: int) -> dict[str, np.ndarray]:
    """A prompt of three quarters of the library's length (so the padding is exercised), random token ids
    below `vocabulary`, empty pasts; `inputs` as in `Shape.static_shapes`."""
    n = max(1, shape.length * 3 // 4)
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, vocabulary, (shape.batch, n), dtype=np.int64),
             "attention_mask": np.ones((shape.batch, n), np.int64),
             "position_ids": np.repeat(np.arange(n, dtype=np.int64)[None], shape.batch, axis=0)}
    dtypes = {i["name"]: i["dtype"] for i in inputs}
    for name, dims in shape.static_shapes(inputs).items():
        if name not in INPUTS:
            feeds[name] = np.zeros(dims, dtypes[name])
    return feeds


def verify(shape: Shape, main, library, device, inputs: list[dict], outputs: list[dict], tolerance) -> dict:
    """The padded route through `library` against the `main` executable on `verification_feeds`:
    {"reference", "prompt" (tokens), "rows" (verify.compare rows per output)}."""
    from ...onnx.runtime import compare_outputs
    from .check import run

    vocabulary = outputs[0]["shape"][-1] if isinstance(outputs[0]["shape"][-1], int) else 2
    feeds = verification_feeds(shape, inputs, vocabulary)
    names = [i["name"] for i in inputs]
    outs = [o["name"] for o in outputs]
    expected = dict(zip(outs, run(main, device, [feeds[n] for n in names])))
    padded = shape.pad(feeds)
    n = feeds["input_ids"].shape[1]
    actual = shape.cut(dict(zip(outs, run(library, device, [padded[name] for name in names]))), n)
    return {"reference": "the main library", "prompt": n, "rows": compare_outputs(expected, actual, tolerance)}
