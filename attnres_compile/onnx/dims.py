"""Sizes for an ONNX model's symbolic input dims, chosen consistently, for verification runs.

A dim_param that is a linear expression of other input dims (`past_sequence_length +
sequence_length`) is computed from them. Free dims get 2 (leading) or 16, 1 in the small set,
or the example sizes a file of ours records (`EXAMPLE_DIMS`); past-like dims get 0 in a second
variant of each set, as a first decode step has them. What the graph itself fixes comes first
(`implied`): a KV cache's head size (onnx/cache_dims.py) and a decoder mask's total length.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping

import onnx

from ..core.errors import ConfigError
from . import io as onnx_io

DEFAULT_BATCH = 2
DEFAULT_DIM = 16
SMALL_DIM = 1
UNKNOWN = onnx_io.UNNAMED_DIM  # a dim_param that names no size
EXAMPLE_DIMS = "attnres.example_dims"  # metadata key: {dim_param: size} of the inputs the file was exported with
MAX_EXAMPLE_DIM = 1 << 20
_PAST = re.compile(r"past|cache", re.IGNORECASE)

Declared = dict[str, list]  # input -> dims: int (static), str (dim_param) or None (unnamed)
Shapes = dict[str, tuple[int, ...]]


def declared(model: onnx.ModelProto) -> Declared:
    """The tensor inputs of `model` (weights listed as inputs aside) and their declared dims (a
    negative dim_value is unknown, as onnxruntime reads it)."""
    weights = {i.name for i in model.graph.initializer}
    return {i.name: [d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else d.dim_param or None
                     for d in i.type.tensor_type.shape.dim]
            for i in model.graph.input if i.name not in weights and i.type.HasField("tensor_type")}


def record_examples(model: onnx.ModelProto, tensors: list) -> None:
    """Record in `model`'s metadata the size each input dim_param had in `tensors` (the example inputs, one per
    graph input in order); a name seen at two sizes is left out."""
    inputs = [i for i in model.graph.input if i.type.HasField("tensor_type")]
    if len(inputs) != len(tensors):
        return
    sizes: dict[str, set[int]] = {}
    for value, tensor in zip(inputs, tensors):
        for d, size in zip(value.type.tensor_type.shape.dim, tuple(tensor.shape)):
            if d.HasField("dim_param") and d.dim_param != UNKNOWN:
                sizes.setdefault(d.dim_param, set()).add(int(size))
    kept = {name: next(iter(s)) for name, s in sizes.items() if len(s) == 1}
    if kept:
        entry = model.metadata_props.add()
        entry.key, entry.value = EXAMPLE_DIMS, json.dumps(kept, sort_keys=True)


def examples(metadata: Mapping[str, str]) -> dict[str, int]:
    """The example sizes `record_examples` wrote ({} where absent or malformed: metadata is the file's word)."""
    try:
        found = json.loads(metadata.get(EXAMPLE_DIMS, "{}"))
    except (ValueError, RecursionError):
        return {}
    if not isinstance(found, dict):
        return {}
    return {k: v for k, v in found.items()
            if isinstance(k, str) and type(v) is int and 1 <= v <= MAX_EXAMPLE_DIM}


def parse(text: str) -> dict[str, int] | None:
    """`text` as a linear form {name: coefficient, "": constant}, or None when it is not an
    expression (one name, or not linear: `a * b`, `a // 2`). Names are what lies between operators."""
    pieces = re.split(r"([+\-*()])", text)
    tokens = []
    for piece in pieces:
        piece = piece.strip()
        if piece in ("+", "-", "*", "(", ")"):
            tokens.append(piece)
        elif piece.isdigit():
            tokens.append(int(piece))
        elif piece:
            tokens.append(("name", piece))
    if not any(t in ("+", "-", "*") for t in tokens):
        return None
    try:
        form, rest = _sum(tokens)
    except (IndexError, ValueError):
        return None
    return form if not rest else None


def _sum(tokens: list) -> tuple[dict[str, int], list]:
    form, tokens = _product(tokens)
    while tokens and tokens[0] in ("+", "-"):
        sign = 1 if tokens[0] == "+" else -1
        term, tokens = _product(tokens[1:])
        for k, v in term.items():
            form[k] = form.get(k, 0) + sign * v
    return form, tokens


def _product(tokens: list) -> tuple[dict[str, int], list]:
    form, tokens = _atom(tokens)
    while tokens and tokens[0] == "*":
        other, tokens = _atom(tokens[1:])
        if set(form) == {""}:
            form, other = other, form
        if set(other) != {""}:
            raise ValueError("not linear")
        form = {k: v * other[""] for k, v in form.items()}
    return form, tokens


def _atom(tokens: list) -> tuple[dict[str, int], list]:
    head = tokens[0]
    if head == "-":
        form, rest = _atom(tokens[1:])
        return {k: -v for k, v in form.items()}, rest
    if head == "(":
        form, rest = _sum(tokens[1:])
        if not rest or rest[0] != ")":
            raise ValueError("unbalanced")
        return form, rest[1:]
    if isinstance(head, int):
        return {"": head}, tokens[1:]
    if isinstance(head, tuple):
        return {head[1]: 1}, tokens[1:]
    raise ValueError(f"unexpected {head!r}")


class Dims:
    """The symbolic dims of a model's inputs: free names (with their defaults) and expressions of them,
    and the sizes the user gave (`--input-shape`), checked against the declaration. The dim name `?`
    is unnamed: paddle2onnx writes it for every unknown dim, not for one shared size."""

    def __init__(self, inputs: Declared, overrides: Shapes | None = None, examples: Mapping[str, int] | None = None,
                 implied: Mapping[str, int] | None = None):
        self.inputs = inputs = {name: [None if d == UNKNOWN else d for d in dims] for name, dims in inputs.items()}
        alone = [d for dims in inputs.values() for d in dims if isinstance(d, str)]
        self.exprs: dict[str, dict[str, int]] = {}
        for text in dict.fromkeys(alone):
            form = parse(text)
            if form is not None and all(name in alone for name in form if name):
                self.exprs[text] = form
        self.implied = {k: v for k, v in (implied or {}).items() if k in alone and k not in self.exprs}
        self.exprs.update(_mask_total(inputs, self.exprs, self.implied))
        self.defaults: dict[str, int] = {}
        for dims in inputs.values():
            for axis, d in enumerate(dims):
                for name in self._names(d):
                    default = DEFAULT_BATCH if axis == 0 else DEFAULT_DIM
                    self.defaults.setdefault(name, (examples or {}).get(name, default))
        others = {d for name, dims in inputs.items() if not _PAST.search(name) for d in dims if d not in self.exprs}
        self.past = [n for n in self.defaults if n not in others]
        self.overrides = dict(overrides or {})
        self.bound, self.constraints = self._bind()

    def _names(self, d) -> Iterable[str]:
        if not isinstance(d, str):
            return ()
        return [n for n in self.exprs[d] if n] if d in self.exprs else [d]

    def _bind(self) -> tuple[dict[str, int], list[tuple[str, str, int]]]:
        unknown = sorted(set(self.overrides) - set(self.inputs))
        if unknown:
            raise ConfigError(f"--input-shape names unknown input {unknown[0]!r}; the model's inputs are "
                              f"{sorted(self.inputs)}")
        bound: dict[str, int] = {}
        constraints = []
        for name, given in self.overrides.items():
            dims = self.inputs[name]
            if len(given) != len(dims):
                raise ConfigError(f"--input-shape {name}: {len(given)} dims given, the input has rank {len(dims)} "
                                  f"{_show(dims)}")
            for d, size in zip(dims, given):
                if isinstance(d, int) and d != size:
                    raise ConfigError(f"--input-shape {name}: dim {d} is static, got {size}")
                if d in self.exprs:
                    constraints.append((name, d, size))
                elif isinstance(d, str) and bound.setdefault(d, size) != size:
                    raise ConfigError(f"--input-shape gives {d} two sizes: {bound[d]} and {size}")
        for name, size in self.implied.items():  # what the graph fixes, unless --input-shape says otherwise
            bound.setdefault(name, size)
        values = self._solve(bound, constraints, self.defaults)
        for name, text, size in constraints:
            if _value(self.exprs[text], values) != size:
                got = " + ".join(f"{n} {values[n]}" for n in self.exprs[text] if n)
                raise ConfigError(f"--input-shape {name}: dim {text!r} is {size}, but the other shapes given make it "
                                  f"{_value(self.exprs[text], values)} ({got})")
        return bound, constraints

    def _solve(self, bound: dict[str, int], constraints, defaults: dict[str, int]) -> dict[str, int]:
        """Free names: `bound`, then solved from the constraints (a size given for an expression dim:
        one unknown is solved for, others take their default, at most what is left, past-like ones
        last), then `defaults`."""
        values = dict(bound)
        while True:
            open_ = [(self.exprs[text], size) for _, text, size in constraints
                     if any(n and n not in values for n in self.exprs[text])]
            if not open_:
                break
            for form, size in open_:
                unknown = [n for n in form if n and n not in values]
                rest = size - sum(c * values.get(n, 0) if n else c for n, c in form.items() if n not in unknown)
                if len(unknown) == 1:
                    values[unknown[0]] = max(rest // form[unknown[0]], 0)
                    break
            else:
                form, size = open_[0]
                name = min((n for n in form if n and n not in values), key=lambda n: n in self.past)
                rest = size - sum(c * values.get(n, 0) if n else c for n, c in form.items() if n != name)
                values[name] = max(min(defaults[name], rest // form[name]), 0) if form[name] > 0 else defaults[name]
        return {**defaults, **values}

    def shapes(self, defaults: dict[str, int], unnamed: tuple[int, int]) -> Shapes | None:
        """One concrete shape per input: overrides as given, free dims from `defaults` (unless
        bound), expressions computed; unnamed dims get `unnamed` (leading, other). None when an
        expression comes out negative."""
        values = self._solve(self.bound, self.constraints, defaults)
        shapes = {}
        for name, dims in self.inputs.items():
            if name in self.overrides:
                shapes[name] = tuple(self.overrides[name])
                continue
            shape = []
            for axis, d in enumerate(dims):
                size = (d if isinstance(d, int) else _value(self.exprs[d], values) if d in self.exprs
                        else values[d] if isinstance(d, str) else unnamed[axis > 0])
                if size < 0:
                    return None
                shape.append(size)
            shapes[name] = tuple(shape)
        return shapes

    def shape_sets(self) -> list[list[Shapes]]:
        """[the default set's variants, the small set's variants] (the small set left out when it is
        the default one, or when a dim expression comes out negative there): each set tried in
        order until the original model runs. ConfigError when no default shapes exist."""
        sets = []
        free_past = [n for n in self.past if n not in self.bound]
        for sizes, unnamed in ((self.defaults, (DEFAULT_BATCH, DEFAULT_DIM)),
                               ({n: SMALL_DIM for n in self.defaults}, (SMALL_DIM, SMALL_DIM))):
            variants = [self.shapes(sizes, unnamed)]
            if free_past:
                variants.append(self.shapes({**sizes, **{n: 0 for n in free_past}}, unnamed))
            variants = list(dict.fromkeys(map(_key, filter(None, variants))))
            if not sets and not variants:
                values = self._solve(self.bound, self.constraints, sizes)
                negative = [text for text, form in self.exprs.items() if _value(form, values) < 0]
                raise ConfigError(f"the dim {negative[0]!r} comes out negative at the default sizes; give the inputs' "
                                  "shapes with --input-shape NAME:1x128")
            if not variants or (sets and [_key(v) for v in sets[0]] == variants):
                continue
            sets.append([dict(v) for v in variants])
        return sets


def _mask_total(inputs: Declared, exprs: dict, implied: Mapping[str, int]) -> dict[str, dict[str, int]]:
    """{mask length name: past + sequence} for a decoder with past inputs whose attention mask has a length dim of
    its own (onnxruntime-genai's `total_sequence_length`); {} where the names do not tell one past length and
    one sequence length apart."""
    past_inputs = [dims for name, dims in inputs.items() if _PAST.search(name)]
    masks = [dims for name, dims in inputs.items() if "mask" in name.lower() and not _PAST.search(name)]
    others = [dims for name, dims in inputs.items() if "mask" not in name.lower() and not _PAST.search(name)]
    free = lambda d: isinstance(d, str) and d not in exprs and d not in implied  # noqa: E731
    past = {dims[-2] for dims in past_inputs if len(dims) >= 3 and free(dims[-2])}
    sequence = {dims[1] for dims in others if len(dims) >= 2 and free(dims[1])}
    totals = {dims[1] for dims in masks if len(dims) == 2 and free(dims[1])}
    used = {d for dims in [*past_inputs, *others] for d in dims}
    if len(past) != 1 or len(sequence) != 1 or past & sequence:
        return {}
    (p,), (s,) = past, sequence
    return {t: {p: 1, s: 1} for t in totals - used}


def _key(shapes: Shapes) -> tuple:
    return tuple(shapes.items())


def _value(form: dict[str, int], values: dict[str, int]) -> int:
    return sum(c * values[n] if n else c for n, c in form.items())


def _show(dims: list) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def describe(shapes: Shapes) -> str:
    """`input_ids 2x16, attention_mask 2x32` (a scalar input as `x scalar`)."""
    return ", ".join(f"{name} {'x'.join(map(str, s)) if s else 'scalar'}" for name, s in shapes.items())
