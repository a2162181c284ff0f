"""onnxruntime backend: sessions, inputs built from a model's input signature, original vs rewritten.

Inputs: symbolic dims get sizes (`--input-shape name:1x128` first, binding its symbols for
every input that shares them; then 2 for a leading dim, 16 for the others); float inputs are
standard normal, integer inputs named like a mask are ones, integer inputs that index an
embedding table (Gather on an initializer) are uniform below the table size, others zero.

`compare_files` runs both models in a forked child (isolate.py) with a time and memory limit:
onnxruntime executes the user's graph, and its crashes and endless loops must not be ours.
"""

from __future__ import annotations

import contextlib
import os
import re

import numpy as np
import onnx
import onnxruntime as ort
import torch

from .. import isolate
from ..errors import ConfigError, ModelRunError
from ..passes import verify

DEFAULT_BATCH = 2
DEFAULT_DIM = 16
SHAPE_SPEC = re.compile(r"^(?P<name>.+):(?P<dims>\d+(?:x\d+)*|)$")


def parse_input_shapes(specs: list[str] | None) -> dict[str, tuple[int, ...]]:
    """{"name": (1, 128)} from ["name:1x128", ...] (a scalar input is "name:")."""
    shapes: dict[str, tuple[int, ...]] = {}
    for spec in specs or []:
        m = SHAPE_SPEC.match(spec)
        if m is None:
            raise ConfigError(f"--input-shape {spec!r} is not of the form name:1x128")
        shapes[m["name"]] = tuple(int(d) for d in m["dims"].split("x")) if m["dims"] else ()
    return shapes


def session(path: str | os.PathLike) -> ort.InferenceSession:
    """A CPU session for the model at `path` (external data is read from beside it)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def index_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """Graph inputs used as Gather indices into an initializer: input -> the table's size on that axis."""
    dims = {i.name: list(i.dims) for i in model.graph.initializer}
    inputs = {i.name for i in model.graph.input}
    bounds: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) == 2 and node.input[1] in inputs and node.input[0] in dims:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            size = dims[node.input[0]][axis]
            bounds[node.input[1]] = min(size, bounds.get(node.input[1], size))
    return bounds


def input_shapes(sess: ort.InferenceSession, overrides: dict[str, tuple[int, ...]] | None = None) -> dict[str, tuple[int, ...]]:
    """Concrete shapes for every input of `sess`: overrides first, then sizes for the remaining symbols."""
    overrides = dict(overrides or {})
    inputs = {i.name: i.shape for i in sess.get_inputs()}
    unknown = sorted(set(overrides) - set(inputs))
    if unknown:
        raise ConfigError(f"--input-shape names unknown input {unknown[0]!r}; the model's inputs are {sorted(inputs)}")
    symbols: dict[str, int] = {}
    for name, given in overrides.items():
        declared = inputs[name]
        if len(given) != len(declared):
            raise ConfigError(f"--input-shape {name}: {len(given)} dims given, the input has rank {len(declared)} {declared}")
        for d, size in zip(declared, given):
            if isinstance(d, int) and d != size:
                raise ConfigError(f"--input-shape {name}: dim {d} is static, got {size}")
            if isinstance(d, str):
                if symbols.setdefault(d, size) != size:
                    raise ConfigError(f"--input-shape gives {d} two sizes: {symbols[d]} and {size}")
    shapes = {}
    for name, declared in inputs.items():
        if name in overrides:
            shapes[name] = overrides[name]
            continue
        shape = []
        for axis, d in enumerate(declared):
            default = DEFAULT_BATCH if axis == 0 else DEFAULT_DIM
            shape.append(d if isinstance(d, int) else symbols.setdefault(d, default) if isinstance(d, str) else default)
        shapes[name] = tuple(shape)
    return shapes


def make_inputs(sess: ort.InferenceSession, model: onnx.ModelProto, overrides: dict | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Feeds for every input of `sess` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    bounds = index_bounds(model)
    shapes = input_shapes(sess, overrides)
    feeds = {}
    for inp in sess.get_inputs():
        dtype = _np_type(inp.type, repr(inp.name))
        shape = shapes[inp.name]
        if np.issubdtype(dtype, np.floating):
            feeds[inp.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_ or "mask" in inp.name.lower():
            feeds[inp.name] = np.ones(shape, dtype)
        elif inp.name in bounds:
            feeds[inp.name] = rng.integers(0, bounds[inp.name], shape).astype(dtype)
        else:
            feeds[inp.name] = np.zeros(shape, dtype)
    return feeds


def _np_type(ort_type: str, name: str = "") -> np.dtype:
    elem = ort_type.removeprefix("tensor(").removesuffix(")")
    table = {"float": np.float32, "double": np.float64, "float16": np.float16, "int64": np.int64, "int32": np.int32,
             "int8": np.int8, "uint8": np.uint8, "bool": np.bool_, "int16": np.int16, "uint16": np.uint16,
             "uint32": np.uint32, "uint64": np.uint64}
    if not ort_type.startswith("tensor(") or elem not in table:
        raise ModelRunError(f"cannot generate a verification input for {name or 'an input'} of type {ort_type} "
                            "(tensors of numeric types only); verify_outputs=False skips verification")
    return np.dtype(table[elem])


def run(sess: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{output name: array} of one run."""
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def compare_outputs(expected: dict[str, np.ndarray], actual: dict[str, np.ndarray], tolerance) -> list[dict]:
    """verify.compare per output with `tolerance` = verify.tolerance(...) (None: no verdict); rows named by output."""
    rows = []
    for name, ref in expected.items():
        if name not in actual:
            rows.append({"output": name, "ok": False, "error": "missing from the rewritten model's outputs"})
            continue
        for row in verify.compare(torch.from_numpy(np.asarray(ref)), torch.from_numpy(np.asarray(actual[name])), tolerance):
            rows.append({**row, "output": name})
    return rows


def run_generated(path: str | os.PathLike, overrides: dict | None = None, seed: int = 0) -> tuple[dict, dict]:
    """(generated inputs, outputs) of the model at `path`, in this process (make_inputs' feeds)."""
    sess = session(path)
    feeds = make_inputs(sess, onnx.load(str(path), load_external_data=False), overrides, seed)
    return feeds, run(sess, feeds)


def run_pair(original: str | os.PathLike, rewritten: str | os.PathLike, overrides: dict | None = None,
             seed: int = 0) -> tuple[dict, dict, dict[str, tuple], tuple | None]:
    """Both models on the same generated inputs, in this process: (expected, actual, input shapes,
    zero-row run); the last is (zeroed inputs, expected, actual) on verify.zero_rows' copy of the
    inputs, None when no input is floating."""
    old = session(original)
    feeds = make_inputs(old, onnx.load(str(original), load_external_data=False), overrides, seed)
    new = session(rewritten)
    expected, actual = run(old, feeds), run(new, feeds)
    zeroed, names = verify.zero_rows(feeds)
    edge = (names, run(old, zeroed), run(new, zeroed)) if names else None
    return expected, actual, {k: tuple(v.shape) for k, v in feeds.items()}, edge


def compare_files(original: str | os.PathLike, rewritten: str | os.PathLike, tolerance: tuple,
                  overrides: dict | None = None, seed: int = 0, timeout: float | None = None,
                  consequence: str = "nothing written") -> tuple[list[dict], dict[str, tuple]]:
    """Run both models (`run_pair`) in an isolated child with `timeout` seconds (default sized to the
    models, `default_timeout`); per-output rows (with their zero-row verdicts) and the input shapes
    used. onnxruntime refusing to run them is a ModelRunError whose hint names --input-shape with
    the model's own input."""
    timeout = timeout or default_timeout(original)
    hint = "Re-run with verify_outputs=False to skip verification"
    try:
        expected, actual, shapes, edge = isolate.run(run_pair, original, rewritten, overrides, seed, what="onnxruntime",
                                                     action="verifying", timeout=timeout, consequence=consequence,
                                                     hint=hint)
    except isolate.ChildError as exc:
        raise ModelRunError(f"{exc}{shape_hint(original)}") from None
    rows = compare_outputs(expected, actual, tolerance)
    if edge and tolerance is not None:
        verify.fold_zero_rows(rows, compare_outputs(edge[1], edge[2], tolerance), edge[0])
    return rows, shapes


def _run_inputs(path: str | os.PathLike, arrays: list[np.ndarray]) -> dict[str, np.ndarray]:
    sess = session(path)
    return run(sess, {i.name: a for i, a in zip(sess.get_inputs(), arrays)})


def run_file(path: str | os.PathLike, arrays: list[np.ndarray], timeout: float | None = None,
             consequence: str = "nothing written") -> dict[str, np.ndarray]:
    """The outputs of the model at `path` on `arrays` (its inputs in order), run in an isolated child."""
    try:
        return isolate.run(_run_inputs, path, arrays, what="onnxruntime", action="verifying",
                           timeout=timeout or default_timeout(path), consequence=consequence,
                           hint="Re-run with verify_outputs=False to skip verification")
    except isolate.ChildError as exc:
        raise ModelRunError(str(exc)) from None


def shape_hint(path: str | os.PathLike) -> str:
    """"; or give its input shape, e.g. --input-shape pixel_values:1x3x320x320" for a model with
    symbolic input dims (the first such input, by its own name), else ""."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001
        return ""
    initializers = {i.name for i in model.graph.initializer}
    for inp in model.graph.input:
        if inp.name in initializers or not inp.type.HasField("tensor_type"):
            continue
        dims = list(inp.type.tensor_type.shape.dim)
        if not any(d.HasField("dim_param") or not d.HasField("dim_value") for d in dims):
            continue
        sizes = [str(d.dim_value) if d.HasField("dim_value") else "1" if i == 0 else "320" if len(dims) == 4 else "128"
                 for i, d in enumerate(dims)]
        return f"; or fix its symbolic dims, e.g. input_shapes={{{inp.name!r}: ({', '.join(sizes)})}}"
    return ""


def default_timeout(path: str | os.PathLike) -> float:
    """Seconds allowed for verifying the model at `path`: 120, plus 120 per GiB of model and weights."""
    p = os.fspath(path)
    folder = os.path.dirname(p) or "."
    size = 0
    with contextlib.suppress(OSError):
        size = os.path.getsize(p) + sum(e.stat().st_size for e in os.scandir(folder)
                                        if e.is_file() and e.name.startswith(os.path.basename(p)) and e.name.endswith(".data"))
    return 120.0 + 120.0 * size / 2**30
