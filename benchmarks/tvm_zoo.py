"""Every HF model of the suite through TVM's default build, against onnxruntime, plus the CUDA build.

    python benchmarks/tvm_zoo.py [NAME ...] [--cuda] [--out zoo.json]

Per model (samples/hf_models.py and samples/hf_zoo.py factories, tiny random configs) and per
route, at the example inputs' shapes:
- `onnx`: the original model exported with the project's exporter (dynamic batch/sequence),
  built with the default schedules at the example shapes, against onnxruntime on that file;
- `legacy`: the same through `torch.onnx.export(dynamo=False)` (TorchScript: every shape computed
  at run time), the exports that broke TVM's importer before the folding pre-pass;
- `attnres`: the Block(2) AttnRes ONNX of `export_onnx`, through `compile_model`, against
  onnxruntime on that file;
- `pt2`: the rewritten program (torch.export) through `compile_model`, against torch eager.
Each row: build seconds (wall), max |diff| / max |reference| over all outputs, and with --cuda
whether the CUDA build succeeds (sm_90 without a GPU; with one, for its arch, then run against
the same reference: `cuda_rel_err`). Failures are rows with their one line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnres_compile import AttnResConfig  # noqa: E402
from attnres_compile.errors import first_line  # noqa: E402

ROUTES = ("onnx", "legacy", "attnres", "pt2")


def factories() -> dict:
    from samples import hf_models, hf_zoo

    suite = {name[:-len("_factory")]: getattr(hf_models, name) for name in dir(hf_models)
             if name.endswith("_factory") and not name.startswith("_")}
    return {**suite, **hf_zoo.ZOO}


class Outputs(torch.nn.Module):
    """A model called with keyword inputs returning its tensors as a flat tuple (ModelOutputs flattened)."""

    def __init__(self, model, keys, constants):
        super().__init__()
        self.model, self.keys, self.constants = model, keys, constants

    def forward(self, *args):
        out = self.model(**dict(zip(self.keys, args)), **self.constants)
        items = out.to_tuple() if hasattr(out, "to_tuple") else out if isinstance(out, (tuple, list)) else (out,)
        return tuple(x for x in items if isinstance(x, torch.Tensor))


def _rel(expected: list[np.ndarray], actual: list[np.ndarray]) -> float:
    return max(float(np.abs(e - a).max() / max(np.abs(e).max(), 1e-30)) for e, a in zip(expected, actual))


def _ort(path: Path, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return session.run(None, {k: v for k, v in feeds.items() if k in names})


def _run_built(built, imported, feeds: dict, device=None) -> list[np.ndarray]:
    import tvm

    from attnres_compile.backends.tvm.check import run

    return run(built.executable, device or tvm.cpu(), [feeds[n] for n in imported.inputs])


def route(name: str, factory, kind: str, folder: Path, cuda: bool) -> dict:
    """One row: build time, error against the reference, CUDA build."""
    from attnres_compile.backends.tvm import compile_model, load
    from attnres_compile.backends.tvm.importers import import_model
    from attnres_compile.backends.tvm.pipeline import build, make_target

    model, inputs = factory()
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    constants = {k: v for k, v in inputs.items() if not isinstance(v, torch.Tensor)}
    wrapped = Outputs(model, list(tensors), constants).eval()
    args = tuple(tensors.values())
    feeds = {k: v.numpy() for k, v in tensors.items()}
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    row = {"model": name, "route": kind}
    start = time.perf_counter()
    if kind in ("onnx", "legacy"):
        path = folder / f"{name}_{kind}.onnx"
        if kind == "onnx":
            from attnres_compile.passes import onnx_export, onnx_io

            auto = torch.export.Dim.AUTO
            dims = tuple({0: auto, **({1: auto} if a.dim() == 2 else {})} for a in args)  # batch, sequence
            proto = onnx_export.export(wrapped, args, None, (dims,))
            onnx_io.write(proto, path)
        else:
            torch.onnx.export(wrapped, args, str(path), dynamo=False, input_names=list(tensors), opset_version=17,
                              dynamic_axes={k: {0: "batch"} for k in tensors})
        if kind == "onnx":  # the exporter names the inputs of forward(*args) args_0, args_1, ...
            names = [i.name for i in onnx.load(str(path), load_external_data=False).graph.input]
            feeds = dict(zip(names, feeds.values()))
            shapes = {k: v.shape for k, v in feeds.items()}
        reference = _ort(path, feeds)
        start = time.perf_counter()
        imported = import_model(path, shapes)
        built = build(imported, make_target("llvm"), input_shapes=shapes)
        row["build_s"] = time.perf_counter() - start
        row["rel_err"] = _rel(reference, _run_built(built, imported, feeds))
        source = path
    else:
        from attnres_compile.onnx_api import export_onnx

        config = AttnResConfig(variant="block", num_blocks=2)
        path = folder / f"{name}_attnres.onnx"
        export_onnx(model, inputs, path, config)
        if kind == "attnres":
            reference, source = _ort(path, feeds), path
        else:
            from attnres_compile import rewrite

            result = rewrite(model, inputs, config)
            source = torch.export.export(result.graph_module, (), {**tensors, **constants})
            with torch.no_grad():
                reference = [x.numpy() for x in torch.utils._pytree.tree_leaves(
                    result.graph_module(**tensors, **constants)) if isinstance(x, torch.Tensor)]
        start = time.perf_counter()
        manifest = compile_model(source, folder / f"{name}_{kind}", input_shapes=shapes, force=True)
        row["build_s"] = time.perf_counter() - start
        row["sites"] = len(manifest["sites"])
        out = load(folder / f"{name}_{kind}")(feeds)
        row["rel_err"] = _rel(reference, list(out.values()))
    if cuda:
        import tvm

        device = tvm.cuda(0)
        arch = "sm_" + device.compute_version.replace(".", "") if device.exist else "sm_90"
        try:
            imported = import_model(source, shapes)
            built = build(imported, make_target("cuda", arch), input_shapes=shapes)
            row["cuda"] = "ok"
            if device.exist:  # on a GPU: run it too
                row["cuda_rel_err"] = _rel(reference, _run_built(built, imported, feeds, device))
        except Exception as exc:  # noqa: BLE001 - recorded in the row
            row["cuda"] = first_line(exc)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="models (default: all)")
    parser.add_argument("--routes", nargs="+", choices=ROUTES, default=list(ROUTES))
    parser.add_argument("--cuda", action="store_true", help="also build each for CUDA sm_90 (no GPU needed)")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    models = factories()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.names or sorted(models):
            for kind in args.routes:
                try:
                    row = route(name, models[name], kind, Path(tmp), args.cuda)
                except Exception as exc:  # noqa: BLE001 - one row per failure
                    row = {"model": name, "route": kind, "error": first_line(exc)[:300]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all("error" not in r and r.get("rel_err", 1) <= 1e-4 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
