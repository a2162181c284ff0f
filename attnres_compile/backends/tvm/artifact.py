"""Deployable artifact folders: `compile_model` writes one (runtime.py's `load` runs it).

The layout and manifest are in docs/tvm.md, *Artifact layout*. The folder is written in a
staging folder beside OUT_DIR and swapped into place when complete (outputs.staged_folder), so a
failed compile leaves nothing and an existing artifact intact.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any, TextIO

import tvm
from tvm import relax

from ...core import __version__
from ...core.errors import CompileError, ConfigError, OutputWriteError, VerificationError, first_line
from ...fx.decoder import GENERATION
from ...onnx import io as onnx_io
from ...utils import outputs
from . import artifact_checks, fixed_shapes, vm_files
from .artifact_checks import artifact_output
from .cuda_binary import write_device_code
from .importers import ImportedModel, import_model
from .pipeline import Built, build, make_target
from .runtime import FORMAT, FORMAT_VERSION, MANIFEST

LIBRARY = "model.so"
ORIGINAL_NOTE = ("the original model: no depth-attention sites, built by the same pipeline as a rewritten one "
                 "(to compare like with like)")
NO_DEVICE = "no CUDA device here to run the build on"
_DISK_ERRORS = [os.strerror(e) for e in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS)]


def compile_model(model: str | os.PathLike | Any, out_dir: str | os.PathLike, target: str = "llvm",
                  arch: str | None = None, tune: bool = False, trials: int | None = None,
                  tuning_db: str | os.PathLike | None = None, input_shapes: dict[str, tuple[int, ...]] | None = None,
                  force: bool = False, progress: TextIO | None = None, tune_minutes: float | None = None,
                  verify_outputs: bool = True, verify_timeout: float | None = None,
                  static_shapes: dict[str, tuple[int, ...]] | None = None,
                  prefill: list[tuple[int, int]] | None = None, decode: list[int] | None = None) -> dict:
    """Compile an AttnRes ONNX file, .pt2 file or ExportedProgram into the artifact folder `out_dir`; returns the manifest.

    `static_shapes` ({input: dims}) fixes symbolic dims (needed to tune); `input_shapes` only sizes
    the verification inputs. A model without sites is built alike (manifest `rewritten`: false).
    `tune` runs meta_schedule for `trials` per task (default 8) and/or `tune_minutes` in all, with
    records in `tuning_db`. With `verify_outputs` the build runs against its source first (check.py;
    CUDA only with a GPU) and a mismatch writes nothing. For a decoder with past, `prefill` adds a
    library per (batch, length) for prompts with an empty past and `decode` one per batch size for
    one-token steps (fixed_shapes.py), each verified against the main library. An existing `out_dir`
    needs `force`.
    """
    out = Path(out_dir)
    _check_output(out, model, force)
    tvm_target = make_target(target, arch)
    verify_shapes = _verification_shapes(static_shapes, input_shapes)
    fixed = fixed_shapes.shapes(prefill, decode)
    imported = import_model(model, static_shapes)
    if fixed:
        fixed_shapes.check_decoder(imported.inputs, imported.outputs)
        if static_shapes:
            raise ConfigError("--prefill and --decode build beside a main library whose batch, sequence and past stay "
                              "symbolic; drop --static-shape")
    if input_shapes and imported.kind != "onnx":
        raise ConfigError("--input-shape sizes the onnxruntime verification of an ONNX source; a .pt2 is verified on "
                          "its stored example inputs (--static-shape fixes its dims in the artifact)")
    built = build(imported, tvm_target, input_shapes=static_shapes, tune=tune, trials=trials,
                  tune_minutes=tune_minutes, tuning_db=tuning_db, progress=progress)
    manifest = _manifest(imported, built, model, static_shapes)
    manifest["rewritten"] = bool(imported.sites)
    if not imported.sites:  # the original (rewrite --no-rewrite, or any model): same pipeline, said so
        manifest["note"] = ORIGINAL_NOTE
    device = _device(tvm_target) if verify_outputs else None
    if verify_outputs:
        manifest["verification"] = _verify(model, imported, built, device, verify_shapes, verify_timeout)
    tolerance = _fixed_tolerance(model, imported) if fixed and device is not None else None
    extra = [_fixed(model, built, shape, manifest, device, tolerance, verify_outputs, progress) for shape in fixed]
    with outputs.staged_folder(out) as stage:
        _save(built.executable, stage / LIBRARY, out)
        manifest.update(artifact_checks.record(stage / LIBRARY))
        for entry, executable in extra:
            _save(executable, stage / entry["library"], out)
            entry.update(artifact_checks.record(stage / entry["library"]))
        for kind in fixed_shapes.KINDS:
            entries = [entry for (entry, _), shape in zip(extra, fixed) if isinstance(shape, kind)]
            if entries:
                manifest[kind.KEY] = entries
        if tvm_target.kind.name == "cuda":
            manifest["cuda"] = write_device_code(built.executable, stage, tvm_target)
        (stage / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _save(executable, path: Path, out: Path) -> None:
    """vm_files.save, a full disk or a failing linker as one line."""
    try:
        vm_files.save(executable, path)
    except Exception as exc:  # noqa: BLE001
        if isinstance(exc, OSError) and exc.errno in outputs.WRITE_ERRNOS:
            raise  # staged_folder's one line, exit 19
        disk = next((reason for reason in _DISK_ERRORS if reason in str(exc)), None)
        if disk:  # the compiler or linker writing the library: a full disk, not a compile error
            raise OutputWriteError(f"cannot write {out}: {disk} (exporting the library); "
                                   f"{outputs.NOTHING_DONE}") from None
        raise CompileError(f"exporting the library failed: {first_line(exc)}") from None


def _fixed(model: Any, main: Built, shape: fixed_shapes.Prefill | fixed_shapes.Decode, manifest: dict, device,
           tolerance, verify_outputs: bool, progress: TextIO | None) -> tuple[dict, tvm.runtime.Executable]:
    """(manifest entry, executable) of the library for `shape`, verified on `device` (None: no device of the
    target here) against `main` within `tolerance` (VerificationError)."""
    if progress is not None:
        print(f"attnres-compile: building {shape.library} for {shape.what}", file=progress, flush=True)
    static = shape.static_shapes(manifest["inputs"])
    try:
        built = build(import_model(model, static), main.target, input_shapes=static)
    except CompileError as exc:  # the main library built: say which library did not
        raise CompileError(f"{shape.library} (--{shape.KEY}): {exc}") from None
    entry = {**vars(shape), "library": shape.library}
    if not verify_outputs:
        return entry, built.executable
    if device is None:
        entry["verification"] = {"skipped": NO_DEVICE}
        return entry, built.executable
    result = fixed_shapes.verify(shape, main.executable, built.executable, device, manifest["inputs"],
                                 manifest["outputs"], tolerance)
    failure = _first_failure(result["rows"])
    if failure:
        raise VerificationError(f"{shape.library} differs from the main library, {result['tokens']} token(s) after a "
                                f"past of {result['past']}, on {failure}; nothing written; verify_outputs=False skips "
                                "this check")
    entry["verification"] = result
    return entry, built.executable


def _fixed_tolerance(model: Any, imported: ImportedModel):
    """check.py's tolerance for the source's depth: the bound each fixed-shape library is checked within."""
    from .check import source_depth, tolerance

    return tolerance(source_depth(model, imported))


def _device(target):
    """The device a build for `target` is checked on here, or None where this machine has none (CUDA)."""
    device = tvm.cuda(0) if target.kind.name == "cuda" else tvm.cpu()
    return device if device.exist else None


def _first_failure(rows: list[dict]) -> str | None:
    """`output 'name'[ at shapes] (what differs[, and N more output(s)])` for the first failed row, None if none failed."""
    failed = [r for r in rows if r.get("ok") is False]
    if not failed:
        return None
    worst = failed[0]
    detail = worst.get("error") or (f"max abs error {worst['max_abs']:.2e}, {worst['min_rtol']:.1e} of its largest "
                                     f"magnitude against {worst['rtol']:.0e} allowed")
    at = f" at {worst['at']}" if worst.get("at") else ""
    more = f", and {len(failed) - 1} more output(s)" if len(failed) > 1 else ""
    return f"output {worst['output']!r}{at} ({detail}{more})"


def _verification_shapes(static: dict | None, given: dict | None) -> dict:
    """The verification inputs' sizes: the frozen shapes, then --input-shape (which must agree with them)."""
    for name, dims in (given or {}).items():
        if name in (static or {}) and tuple(static[name]) != tuple(dims):
            raise ConfigError(f"--input-shape {name}:{'x'.join(map(str, dims))} differs from its --static-shape "
                              f"{name}:{'x'.join(map(str, static[name]))}: the artifact only takes the static shape")
    return {**(given or {}), **(static or {})}


def _verify(model: Any, imported: ImportedModel, built: Built, device, input_shapes: dict | None,
            timeout: float | None) -> dict:
    """check.check's result on `device` (None: skipped); VerificationError naming the outputs that differ."""
    from .check import check

    if device is None:
        return {"skipped": NO_DEVICE}
    result = check(model, imported, built.executable, device, input_shapes, timeout)
    failure = _first_failure(result.get("rows", []))
    if failure:
        raise VerificationError(f"the compiled model differs from {result['reference']} on {failure}; "
                                "nothing written; verify_outputs=False skips this check")
    return result


def _manifest(imported: ImportedModel, built: Built, model: Any, static_shapes: dict | None) -> dict:
    main = built.mod["main"]
    sites = [{**site, **lowered} for site, lowered in zip(imported.sites, built.sites)]
    outputs = main.ret_ty.fields if isinstance(main.ret_ty, relax.TupleType) else [main.ret_ty]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "library": LIBRARY,
        "device": "cuda" if built.target.kind.name == "cuda" else "cpu",
        "target": json.loads(str(built.target)),
        "source": {"kind": imported.kind,
                   "path": str(Path(model).resolve()) if isinstance(model, (str, os.PathLike)) else None},
        "inputs": [{"name": n, **_describe(p.ty)} for n, p in zip(imported.inputs, main.params)],
        "outputs": [{"name": n, **_describe(ty)} for n, ty in zip(imported.outputs, outputs)],
        "static_shapes": {k: list(v) for k, v in (static_shapes or {}).items()},
        "sites": sites,
        "kernels": sorted({s["kernel"] for s in sites}),
        "tuning": built.tuning,
        "versions": {"tvm": tvm.__version__, "attnres_compile": __version__},
        **({GENERATION: imported.generation} if imported.generation else {}),  # for `generate`
    }


def _describe(ty) -> dict:
    """shape (ints, symbolic dims by name, None for an unknown dim; None for unknown rank) and dtype."""
    if not isinstance(ty, relax.TensorType):
        return {"shape": None, "dtype": None}
    shape = None
    if isinstance(ty.shape, relax.ShapeExpr):
        shape = [int(d) if isinstance(d, tvm.tirx.IntImm) else dim_text(d) for d in ty.shape.values]
    elif ty.ndim >= 0:
        shape = [None] * ty.ndim
    return {"shape": shape, "dtype": str(ty.dtype)}


_OPERATORS = ((tvm.tirx.Add, "+", 1), (tvm.tirx.Sub, "-", 1), (tvm.tirx.Mul, "*", 2), (tvm.tirx.FloorDiv, "//", 2),
              (tvm.tirx.FloorMod, "%", 2), (tvm.tirx.Div, "/", 2), (tvm.tirx.Mod, "%", 2))


def dim_text(expr) -> str:
    """A symbolic dim as a person writes it: `(height - 1) // 32 + 1`, `2 * seq`, not TVM's
    `T.int64(...)`-laden script form; casts are transparent."""
    return _text(expr)[0]


def _text(expr) -> tuple[str, int]:
    """(text, precedence): 1 for + and -, 2 for * / // %, 3 for atoms."""
    if isinstance(expr, (tvm.tirx.IntImm, tvm.tirx.FloatImm)):
        return str(expr.value), 3
    if isinstance(expr, tvm.tirx.Var):
        return expr.name, 3
    if isinstance(expr, tvm.tirx.Cast):
        return _text(expr.value)
    if isinstance(expr, (tvm.tirx.Min, tvm.tirx.Max)):
        return f"{type(expr).__name__.lower()}({dim_text(expr.a)}, {dim_text(expr.b)})", 3
    for kind, symbol, level in _OPERATORS:
        if isinstance(expr, kind):
            (a, pa), (b, pb) = _text(expr.a), _text(expr.b)
            a = a if pa >= level else f"({a})"
            b = b if pb > level or (pb == level and symbol in "+*") else f"({b})"
            return f"{a} {symbol} {b}", level
    return str(expr), 3


def _check_output(out: Path, model: Any, force: bool) -> None:
    """outputs.check for the artifact folder: never one holding the model (or its weights) or the working
    folder; an existing one only with `force`, and only when it is an artifact (manifest.json)."""
    inputs = onnx_io.files_of(Path(model)) if isinstance(model, (str, os.PathLike)) else []
    outputs.check([artifact_output(out, "output")], inputs, force)
