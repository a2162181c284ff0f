"""`attnres-compile compile` and `attnres-compile run`: TVM artifacts from the command line.

`add_commands(subparsers)` registers both on the main parser's subparsers; each sets
`handler`, a function of the parsed args returning the exit code (errors are raised as
AttnResError and turned into one line and their exit code by the main CLI).
"""

from __future__ import annotations

import argparse
import math
import sys
import zipfile
from pathlib import Path

from ... import isolate, outputs, progress
from ...cli_args import seconds
from ...errors import InputError, MemoryLimitError, first_line
from ...file_kind import check_file, describe


def add_commands(subparsers) -> None:
    """Register `compile` and `run` on `subparsers` (from ArgumentParser.add_subparsers)."""
    comp = subparsers.add_parser("compile", help="compile an AttnRes model (.onnx or .pt2) into a TVM artifact folder")
    comp.add_argument("model", help="rewritten model: MODEL.onnx (attnres-compile rewrite) or MODEL.pt2 (torch.export)")
    comp.add_argument("-o", "--output", required=True, help="artifact folder to write (model.so, manifest.json)")
    comp.add_argument("--target", choices=["llvm", "cuda"], default="llvm",
                      help="llvm: this machine's CPU; cuda: NVIDIA GPUs (builds without one)")
    comp.add_argument("--arch", help="CUDA architecture, e.g. sm_90 (default sm_90; --target cuda only)")
    comp.add_argument("--tune", action="store_true",
                      help="tune the operators around the kernels with meta_schedule, starting from the default "
                           "schedules (CPU, static shapes: see --static-shape)")
    comp.add_argument("--trials", type=int, help="tuning trials per operator (default 8; implies --tune)")
    comp.add_argument("--tune-minutes", type=float, metavar="N",
                      help="tuning time budget in minutes for the whole model (implies --tune; with --trials, "
                           "whichever ends first)")
    comp.add_argument("--tuning-db", help="folder keeping tuning records; a later compile reuses them")
    comp.add_argument("--input-shape", action="append", metavar="NAME:1x128",
                      help="an input's shape for the verification run (repeatable); the artifact keeps its "
                           "symbolic dims")
    comp.add_argument("--static-shape", action="append", metavar="NAME:1x128",
                      help="fix an input's symbolic dims in the artifact (repeatable); needed to tune")
    comp.add_argument("--force", action="store_true", help="replace the output folder if it exists")
    comp.add_argument("--no-verify", action="store_true",
                      help="skip running the compiled model against its source (onnxruntime, or torch on a .pt2's "
                           "example inputs)")
    comp.add_argument("--verify-timeout", type=seconds, metavar="SECONDS",
                      help="time limit of the onnxruntime reference run (default: 120 s plus 120 s per GiB of model)")
    comp.set_defaults(handler=compile_command)

    run = subparsers.add_parser("run", help="run a compiled artifact on inputs from an .npz file")
    run.add_argument("artifact", help="artifact folder written by `attnres-compile compile`")
    run.add_argument("--inputs", required=True, help=".npz file with one array per model input, by name")
    run.add_argument("-o", "--output", required=True, help=".npz file to write the outputs to, by name")
    run.add_argument("--force", action="store_true", help="overwrite the output file if it exists")
    run.add_argument("--profile", action="store_true",
                     help="also print the time of each kernel per forward (VM instrumentation, process CPU clock)")
    run.set_defaults(handler=run_command)
    for sp in (comp, run):
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")


def compile_command(args) -> int:
    from ...passes.onnx_dims import describe as describe_shapes
    from ..onnxruntime import parse_input_shapes
    from .artifact import compile_model

    # sys.__stderr__: the main CLI hides sys.stderr without --debug; progress stays visible.
    # In an isolated child (isolate.py): TVM's importers and builder run the user's graph and can crash.
    try:
        tune = args.tune or args.trials is not None or args.tune_minutes is not None
        with progress.stage(f"compiling {Path(args.model).name} for {args.target}" + (", tuning" if tune else ""),
                            lines_follow=tune):  # tuning prints a line per task
            manifest = isolate.run(compile_model, args.model, args.output, target=args.target, arch=args.arch,
                                   tune=tune, trials=args.trials, tune_minutes=args.tune_minutes, tuning_db=args.tuning_db,
                                   input_shapes=parse_input_shapes(args.input_shape),
                                   static_shapes=parse_input_shapes(args.static_shape, "--static-shape"), force=args.force,
                                   progress=sys.__stderr__, verify_outputs=not args.no_verify,
                                   verify_timeout=args.verify_timeout, what="TVM", action="compiling", timeout=None,
                                   consequence="nothing written")
    finally:
        outputs.clean_stale(Path(args.output))  # the staging folder of a child that crashed
    kernels = len(manifest["kernels"])
    print(f"compiled {len(manifest['sites'])} depth-attention sites ({kernels} fused kernels) for "
          f"{manifest['target']['kind']} into {args.output}")
    for io in ("inputs", "outputs"):
        print(f"  {io}: " + ", ".join(f"{x['name']} {x['dtype']}[{dims(x['shape'])}]" for x in manifest[io]))
    check = manifest.get("verification")
    if check and "skipped" in check:
        print(f"  not verified: {check['skipped']}")
    elif check:
        from ...passes.verify import describe as describe_row  # torch: after the compile, not for the parser
        from ...passes.verify import nothing_compared

        shapes = "; ".join(describe_shapes(s) for s in check.get("verified_shapes") or [check["inputs"]])
        empty = nothing_compared(check["rows"])
        print(f"  not verified against {check['reference']} at {shapes}: {empty}" if empty else
              f"  verified against {check['reference']} at {shapes}:")
        for row in check["rows"]:
            print(f"    {describe_row(row)}" + (f"  at {row['at']}" if row.get("at") else ""))
        for note in check.get("notes", []):
            print(f"  note: {note}")
    if manifest["tuning"]:
        t = manifest["tuning"]
        gain = f"; tuned operators {t['best_us']:.0f} us vs {t['default_us']:.0f} us default" if t.get("best_us") else ""
        print(f"  tuning: {t['tuned']} tasks tuned ({t['measured']} trials), {t['reused']} reused from {t['database']}"
              + (f", {t['untunable']} left at the default schedule (no trial ran)" if t.get("untunable") else "")
              + gain)
    return 0


def run_command(args) -> int:
    import numpy as np

    from .runtime import load

    path = Path(args.inputs)
    check_file(path, "an .npz of input arrays")
    kind = describe(path)
    if kind != "an .npz archive of arrays":
        raise InputError(f"{path} is {kind}, not an .npz of input arrays (numpy.savez(path, name=array, ...))")
    artifact = load(args.artifact)
    check_declared(path, declared_arrays(path), artifact.manifest["inputs"])
    try:
        with np.load(path, allow_pickle=False) as data:
            inputs = {k: data[k] for k in data.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise InputError(f"{path}: not an .npz file ({first_line(exc)})") from None
    results = artifact(inputs)
    out = Path(args.output)
    with outputs.staged(out) as stage, open(stage.path, "wb") as f:
        np.savez(f, **results)
    print("wrote " + str(out) + ": " + ", ".join(f"{k} {v.dtype}[{dims(v.shape)}]" for k, v in results.items()))
    if args.profile:
        from .profile import format_table, profile

        print(format_table(profile(args.artifact, artifact.checked(inputs), device=artifact.manifest["device"])))
    return 0


def declared_arrays(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{name: (shape, dtype)} of the arrays of the .npz at `path`, from their .npy headers only (a few
    bytes each, whatever the arrays' size or compression)."""
    import numpy as np
    from numpy.lib import format as npy

    declared = {}
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                with z.open(info) as f:
                    version = npy.read_magic(f)
                    if version not in ((1, 0), (2, 0)):
                        raise ValueError(f"unsupported .npy format version {version}")
                    read = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
                    shape, _, dtype = read(f)
                declared[info.filename.removesuffix(".npy")] = (tuple(int(d) for d in shape), np.dtype(dtype))
    except (OSError, ValueError, TypeError, zipfile.BadZipFile, EOFError, RuntimeError, NotImplementedError) as exc:
        raise InputError(f"{path}: not an .npz file ({first_line(exc)})") from None
    return declared


def check_declared(path: Path, declared: dict, specs: list[dict]) -> None:
    """Refuse, before any array is read, inputs whose headers do not fit the model (names, ranks, static
    dims) or that together declare more bytes than the memory budget (a bomb: a small file claiming
    terabytes, or gigabytes of zeros compressed to megabytes)."""
    names = [s["name"] for s in specs]
    if sorted(declared) != sorted(names):
        raise InputError(f"{path}: inputs must be exactly {names}: missing {sorted(set(names) - set(declared))}, "
                         f"unknown {sorted(set(declared) - set(names))}")
    for spec in specs:
        shape, want = declared[spec["name"]][0], spec["shape"]
        fits = want is None or (len(want) == len(shape) and all(not isinstance(w, int) or w == g
                                                                 for w, g in zip(want, shape)))
        if not fits:
            raise InputError(f"{path}: input {spec['name']}: shape {list(shape)}, expected {want}")
    total = sum(math.prod(shape) * dtype.itemsize for shape, dtype in declared.values())
    budget = isolate.memory_budget()
    if total > budget:
        raise MemoryLimitError(f"{path}: its arrays declare {total / 2**30:.1f} GiB, more than the memory limit "
                               f"{budget / 2**30:.1f} GiB ({isolate.MEMORY_ENV}); nothing was read or run")


def dims(shape) -> str:
    """A shape as `1, 128` or `batch, seq` (symbolic dims by name; `?` unknown), not a Python list."""
    if shape is None:
        return "?"
    return ", ".join("?" if d is None else str(d) for d in shape)
