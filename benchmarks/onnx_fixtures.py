"""Every ONNX model the onnx wheel ships as test data, through TVM's default build, against onnxruntime.

    python benchmarks/onnx_fixtures.py [SUBSTRING ...] [--cuda] [--out fixtures.json]

The files are onnx/backend/test/data/{light,pytorch-converted,pytorch-operator,simple}: nine
ONNX model zoo architectures (ResNet50, DenseNet121, Inception v1/v2, ShuffleNet, SqueezeNet,
VGG19, AlexNet, ZFNet512 at opset 9, IR version 3, their weights constant fills) and ~140 small
single-purpose models at opsets 6 to 12. Per model: onnxruntime runs the file on its test-data
inputs (random ones for the light models); a file onnxruntime refuses is a row `ort-refuses`,
out of scope. Otherwise it is read as `compile` reads it (onnx_io.load: opsets below 15
converted), imported at those input shapes, built for llvm and run: `ok` when every output has
onnxruntime's shape, NaN where it has NaN, and differs by at most 1e-4 of the output's largest
magnitude; `mismatch` otherwise; `error` with the one line the build failed with. With --cuda
the CUDA build (sm_90, no GPU needed) is tried too.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnres_compile.core.errors import first_line  # noqa: E402

ROOT = Path(onnx.__file__).parent / "backend" / "test" / "data"
RTOL = 1e-4


def models() -> list[Path]:
    return [Path(p) for p in sorted(glob.glob(str(ROOT / "*" / "*" / "model.onnx")))
            + sorted(glob.glob(str(ROOT / "light" / "*.onnx")))]


def feeds(path: Path, model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The test data set's inputs, or (light models) seeded normal draws at the declared shapes."""
    weights = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in weights]
    files = sorted((path.parent / "test_data_set_0").glob("input_*.pb"))
    if files:
        out = {}
        for value, file in zip(inputs, files):
            tensor = onnx.TensorProto()
            tensor.ParseFromString(file.read_bytes())
            out[value.name] = numpy_helper.to_array(tensor)
        return out
    rng = np.random.default_rng(0)
    return {i.name: rng.standard_normal([d.dim_value or 1 for d in i.type.tensor_type.shape.dim]).astype(
        onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)) for i in inputs}


def compare(expected: list[np.ndarray], actual: list[np.ndarray]) -> tuple[str, float | None]:
    """("ok" | "mismatch", max |diff| / max |expected| over the outputs)."""
    if len(expected) != len(actual) or any(e.shape != a.shape for e, a in zip(expected, actual)):
        return "mismatch", None
    worst = 0.0
    for e, a in zip(expected, actual):
        if e.dtype.kind in "fc":
            if not np.array_equal(np.isnan(e), np.isnan(a)):
                return "mismatch", None
            e, a = np.nan_to_num(e), np.nan_to_num(a)
        e, a = e.astype(np.float64), a.astype(np.float64)
        worst = max(worst, float(np.abs(e - a).max() / max(np.abs(e).max(), 1e-30)) if e.size else 0.0)
    return ("ok" if worst <= RTOL else "mismatch"), worst


def row(path: Path, cuda: bool) -> dict:
    import onnxruntime as ort
    import tvm

    from attnres_compile.backends.tvm.check import run
    from attnres_compile.backends.tvm.importers import import_model
    from attnres_compile.backends.tvm.pipeline import build, make_target

    ort.set_default_logger_severity(3)  # its per-file warnings (initializers listed as inputs)
    out = {"model": str(path.relative_to(ROOT))}
    model = onnx.load(str(path))
    out["opset"] = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    inputs = feeds(path, model)
    try:
        expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, inputs)
    except Exception as exc:  # noqa: BLE001
        return out | {"status": "ort-refuses", "error": first_line(exc)[:200]}
    shapes = {k: v.shape for k, v in inputs.items()}
    start = time.perf_counter()
    try:
        imported = import_model(path, shapes)
        built = build(imported, make_target("llvm"), input_shapes=shapes)
        out["build_s"] = round(time.perf_counter() - start, 2)
        actual = run(built.executable, tvm.cpu(), [inputs[n] for n in imported.inputs])
        out["status"], out["rel_err"] = compare(expected, actual)
    except Exception as exc:  # noqa: BLE001 - recorded in the row
        return out | {"status": "error", "error": first_line(exc)[:300], "error_lines": len(str(exc).splitlines())}
    if cuda:
        try:
            build(imported, make_target("cuda", "sm_90"), input_shapes=shapes)
            out["cuda"] = "ok"
        except Exception as exc:  # noqa: BLE001
            out["cuda"] = first_line(exc)[:300]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="run only the files whose path contains one of these")
    parser.add_argument("--cuda", action="store_true", help="also build each model for CUDA (sm_90)")
    parser.add_argument("--out", default="onnx_fixtures.json")
    args = parser.parse_args(argv)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for path in models():
            if args.names and not any(n in str(path) for n in args.names):
                continue
            rows.append(row(path, args.cuda))
            print(json.dumps(rows[-1]), flush=True)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "mismatch", "error", "ort-refuses")}
    print(f"{len(rows)} models: " + ", ".join(f"{n} {s}" for s, n in counts.items()), file=sys.stderr)
    Path(args.out).write_text(json.dumps({"summary": counts, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
