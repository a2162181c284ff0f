"""onnxruntime backend: sessions, inputs built from a model's input signature, original vs rewritten.

Inputs: dims sized by onnx/dims.py; floats standard normal, mask-like integers ones, embedding
indices below the table size, other integers zero. `compare_files` runs both models in a forked,
limited child (isolate.py). Verification uses `reference_session` (exact Sigmoid,
exact_sigmoid.py); `session` runs the file as it is.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import torch

from ..core import verify
from ..core.errors import ConfigError, ModelRunError, first_line
from ..utils import isolate
from . import cache_dims as onnx_cache_dims
from . import dims as onnx_dims
from . import quantize_steps as onnx_quantize_steps
from .exact_sigmoid import exact_sigmoids

# where a session made from bytes reads external data (else: refused, "escapes working directory")
EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"
SHAPE_SPEC = re.compile(r"^(?P<name>.+):(?P<dims>\d+(?:x\d+)*|)$")


def parse_input_shapes(specs: list[str] | None, option: str = "--input-shape") -> dict[str, tuple[int, ...]]:
    """{"name": (1, 128)} from ["name:1x128", ...] (a scalar input is "name:"); errors name `option`."""
    shapes: dict[str, tuple[int, ...]] = {}
    for spec in specs or []:
        m = SHAPE_SPEC.match(spec)
        if m is None:
            raise ConfigError(f"{option} {spec!r} is not of the form name:1x128")
        shapes[m["name"]] = tuple(int(d) for d in m["dims"].split("x")) if m["dims"] else ()
    return shapes


def session(path: str | os.PathLike) -> ort.InferenceSession:
    """A CPU session for the model at `path` (external data is read from beside it)."""
    return ort.InferenceSession(str(path), _options(), providers=["CPUExecutionProvider"])


def reference_session(path: str | os.PathLike, model: onnx.ModelProto | None = None,
                      edit: Callable[[onnx.ModelProto], object] | None = None) -> ort.InferenceSession:
    """The session verification compares against: the model at `path` (or `model`, edited in place) with
    exact Sigmoids and `edit` applied, external data read from beside `path`."""
    model = onnx.load(str(path), load_external_data=False) if model is None else model
    if not exact_sigmoids(model) and edit is None:
        return session(path)
    if edit is not None:
        edit(model)
    options = _options()
    options.add_session_config_entry(EXTERNAL_DATA_FOLDER, os.path.dirname(os.path.abspath(path)))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _options() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return options


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


def input_shapes(sess: ort.InferenceSession, overrides: dict[str, tuple[int, ...]] | None = None,
                 model: onnx.ModelProto | None = None) -> dict[str, tuple[int, ...]]:
    """Concrete shapes for every input of `sess`: the default shape set (onnx_dims), overrides first."""
    return symbolic_dims(sess, overrides, model).shape_sets()[0][0]


def symbolic_dims(sess: ort.InferenceSession, overrides: dict[str, tuple[int, ...]] | None = None,
                  model: onnx.ModelProto | None = None) -> onnx_dims.Dims:
    """The sizes for `sess`'s symbolic dims: `overrides`, else what `model`'s graph fixes (a KV cache's head
    size: onnx/cache_dims.py), else the file's recorded example sizes, else the defaults."""
    implied = {k: v.size for k, v in onnx_cache_dims.head_sizes(model).items()} if model is not None else None
    return onnx_dims.Dims(declared(sess), overrides, onnx_dims.examples(sess.get_modelmeta().custom_metadata_map),
                          implied)


def declared(sess: ort.InferenceSession) -> onnx_dims.Declared:
    """{input: dims} as the session declares them (ints, dim_param names, None)."""
    return {i.name: list(i.shape) for i in sess.get_inputs()}


def make_inputs(sess: ort.InferenceSession, model: onnx.ModelProto, overrides: dict | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Feeds for every input of `sess` at the default shapes (see the module docstring)."""
    return feeds_at(sess, model, input_shapes(sess, overrides, model), seed)


def feeds_at(sess: ort.InferenceSession, model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]],
             seed: int = 0) -> dict[str, np.ndarray]:
    """Feeds for every input of `sess` with the given `shapes` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    bounds = index_bounds(model)
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


class _Pair:
    """The original's and the rewritten's sessions for `run_sets`. A quantized original records its quantize
    steps, and the rewritten model quantizes with them (onnx/quantize_steps.py, with a margin of `rtol`)."""

    def __init__(self, original, model: onnx.ModelProto, rewritten, rtol: float):
        self.rewritten, self.rtol = rewritten, rtol
        self.steps = onnx_quantize_steps.steps(model) if rewritten is not None else []
        self.recorded: list[str] = []
        self.inputs: dict[str, str] = {}
        self.other = None
        record = (lambda m: self.recorded.extend(onnx_quantize_steps.record(m, self.steps))) if self.steps else None
        self.original = reference_session(original, model, record)

    def expected(self, feeds: dict) -> tuple[dict, dict]:
        """The original's outputs and its recorded quantize steps."""
        out = run(self.original, feeds)
        return {k: v for k, v in out.items() if k not in self.recorded}, {k: out[k] for k in self.recorded}

    def actual(self, feeds: dict, recorded: dict) -> dict:
        """The rewritten model's outputs, its quantize steps fixed by `recorded` (the original's, same feeds)."""
        if self.other is None:
            fix = (lambda m: self.inputs.update(onnx_quantize_steps.fix_steps(m, self.steps, recorded, self.rtol))
                   ) if self.steps else None
            self.other = reference_session(self.rewritten, edit=fix)
        return run(self.other, {**feeds, **{name: recorded[key] for name, key in self.inputs.items()}})


def run_sets(original: str | os.PathLike, rewritten: str | os.PathLike | None = None, overrides: dict | None = None,
             seed: int = 0, rtol: float = verify.PRESERVE_RTOL) -> list[dict]:
    """Both models at each shape set (onnx_dims), in this process: per set {"shapes", "feeds",
    "expected", "actual"} at the first variant the original runs, else {"refused", "past", "mask",
    "symbolic"}. A quantized original's quantize steps are fixed in the rewritten one (`_Pair`)."""
    model = onnx.load(str(original), load_external_data=False)
    pair = _Pair(original, model, rewritten, rtol)
    sess = pair.original
    dims = symbolic_dims(sess, overrides, model)
    results: list[dict] = []
    for variants in dims.shape_sets():
        refused = []
        for shapes in variants:
            feeds = feeds_at(sess, model, shapes, seed)
            try:
                expected, recorded = pair.expected(feeds)
            except Exception as exc:  # noqa: BLE001 - onnxruntime refusing these shapes (ORT's own error classes)
                if isolate.out_of_memory(f"{type(exc).__name__}: {exc}"):
                    raise
                refused.append((shapes, first_line(exc)))
                continue
            result = {"shapes": shapes, "feeds": feeds, "expected": expected}
            if rewritten is not None:
                try:
                    result["actual"] = pair.actual(feeds, recorded)
                    zeroed, names = verify.zero_rows(feeds)
                    if names and not results:  # the default set, also with zero rows (verify.zero_rows)
                        edge, edge_recorded = pair.expected(zeroed)
                        result["edge"] = (names, edge, pair.actual(zeroed, edge_recorded))
                except Exception as exc:  # noqa: BLE001 - reported as a failed verification
                    if isolate.out_of_memory(f"{type(exc).__name__}: {exc}"):
                        raise
                    result["actual"] = first_line(exc)
            results.append(result)
            break
        else:
            results.append({"refused": refused, "past": [n for n in dims.past if n not in dims.bound],
                            "mask": next((n for n in dims.inputs if "mask" in n.lower()), None),
                            "symbolic": any(not isinstance(d, int) for ds in dims.inputs.values() for d in ds)})
            if len(results) == 1:
                break
    return results


def verification_runs(original: str | os.PathLike, rewritten: str | os.PathLike | None, overrides: dict | None,
                      seed: int = 0, timeout: float | None = None, consequence: str = "nothing written",
                      rtol: float = verify.PRESERVE_RTOL) -> tuple[list[dict], list[str]]:
    """`run_sets` in an isolated child with `timeout` seconds (default sized to the models,
    `default_timeout`): the sets that ran, and notes on a small set the original refused. The
    original refusing the default set is a ModelRunError naming the shapes tried, never a guess."""
    hint = "Re-run with verify_outputs=False to skip verification"
    try:
        results = isolate.run(run_sets, original, rewritten, overrides, seed, rtol, what="onnxruntime", action="verifying",
                              timeout=timeout or default_timeout(original), consequence=consequence, hint=hint)
    except isolate.ChildError as exc:
        raise ModelRunError(str(exc)) from None
    if "refused" in results[0]:
        raise ModelRunError(_refusal(results[0], consequence, hint))
    notes = _graph_notes(original, overrides, rewritten is not None)
    notes += [f"not verified at the small shapes ({onnx_dims.describe(r['refused'][0][0])}): the original model "
              f"fails there in onnxruntime ({r['refused'][0][1]})" for r in results[1:] if "refused" in r]
    return [r for r in results if "refused" not in r], notes


def _graph_notes(original: str | os.PathLike, overrides: dict | None, compared: bool) -> list[str]:
    """A note per symbolic dim verification sized from the graph (onnx/cache_dims.py), unless --input-shape sized
    it, and on a quantized original's steps fixed for the comparison (`compared`: a rewritten model is run)."""
    model = onnx.load(str(original), load_external_data=False)
    given = {d.dim_param for i in model.graph.input if i.name in (overrides or {}) for d in i.type.tensor_type.shape.dim}
    notes = [f"verified with {i.name} = {i.size}: {i.why}" for i in onnx_cache_dims.head_sizes(model).values()
             if i.name not in given]
    steps = onnx_quantize_steps.steps(model) if compared else []
    if steps:
        notes.append(f"quantized model: the rewritten model's {len(steps)} quantize step(s) fixed by the original's "
                     "activations for the comparison (a rounding-level difference at a rounding boundary is no "
                     "change; onnx/quantize_steps.py)")
    return notes


def _refusal(result: dict, consequence: str, hint: str) -> str:
    """The original model refused every variant of the default shape set: what was tried, and how to give shapes."""
    (shapes, error), *others = result["refused"]
    tried = onnx_dims.describe(shapes) or "its declared shapes"
    if others:
        tried += f", and again with {', '.join(result['past'])} 0"
    rule = ""
    if result["past"] and result["mask"]:
        rule = f" ({result['mask']}'s length is the past length plus the sequence length)"
    give = f"; or give the inputs' shapes with input_shapes{rule}" if result["symbolic"] else ""
    return (f"onnxruntime failed on the original model ({error}) at the shapes tried: {tried}; {consequence}. "
            f"{hint}{give}")


def compare_files(original: str | os.PathLike, rewritten: str | os.PathLike, tolerance: tuple,
                  overrides: dict | None = None, seed: int = 0, timeout: float | None = None,
                  consequence: str = "nothing written") -> tuple[list[dict], list[dict], list[str]]:
    """Both models at the default and the small shape set (`verification_runs`): per-output rows
    (`merge_rows`), the shape sets compared, and notes. The rewritten model failing where the
    original runs is a failed row."""
    rtol = tolerance.rtol if tolerance is not None else verify.PRESERVE_RTOL
    runs, notes = verification_runs(original, rewritten, overrides, seed, timeout, consequence, rtol)
    per_set = []
    for r in runs:
        if isinstance(r["actual"], str):
            rows = [{"output": "onnxruntime", "ok": False, "verdict": "fail",
                     "error": f"the rewritten model fails where the original runs ({r['actual']})"}]
        else:
            rows = compare_outputs(r["expected"], r["actual"], tolerance)
            if r.get("edge") and tolerance is not None:
                names, expected, actual = r["edge"]
                verify.fold_zero_rows(rows, compare_outputs(expected, actual, tolerance), names)
        per_set.append((r["shapes"], rows))
    return merge_rows(per_set), [r["shapes"] for r in runs], notes


def merge_rows(per_set: list[tuple[dict, list[dict]]]) -> list[dict]:
    """One row per output over the shape sets: the first failing one, else the first; a row of a
    later set carries its shapes ("at")."""
    merged: dict[str, dict] = {}
    for index, (shapes, rows) in enumerate(per_set):
        for row in rows:
            if index:
                row = {**row, "at": onnx_dims.describe(shapes)}
            old = merged.get(row["output"])
            if old is None or (row.get("ok") is False and old.get("ok") is not False):
                merged[row["output"]] = row
    return list(merged.values())


def _run_inputs(path: str | os.PathLike, arrays: list[np.ndarray]) -> dict[str, np.ndarray]:
    sess = reference_session(path)
    return run(sess, {i.name: a for i, a in zip(sess.get_inputs(), arrays)})


def run_file(path: str | os.PathLike, arrays: list[np.ndarray], timeout: float | None = None,
             consequence: str = "nothing written") -> dict[str, np.ndarray]:
    """The outputs of the model at `path` on `arrays` (its inputs in order), run in an isolated child
    (`reference_session`: Sigmoid exact)."""
    try:
        return isolate.run(_run_inputs, path, arrays, what="onnxruntime", action="verifying",
                           timeout=timeout or default_timeout(path), consequence=consequence,
                           hint="Re-run with verify_outputs=False to skip verification")
    except isolate.ChildError as exc:
        raise ModelRunError(str(exc)) from None


def default_timeout(path: str | os.PathLike) -> float:
    """Seconds allowed for verifying the model at `path`: 120, plus 120 per GiB of model and weights."""
    p = os.fspath(path)
    folder = os.path.dirname(p) or "."
    size = 0
    with contextlib.suppress(OSError):
        size = os.path.getsize(p) + sum(e.stat().st_size for e in os.scandir(folder)
                                        if e.is_file() and e.name.startswith(os.path.basename(p)) and e.name.endswith(".data"))
    return 120.0 + 120.0 * size / 2**30
