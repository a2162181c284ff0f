"""`attnres-compile compile` and `attnres-compile run`: TVM artifacts from the command line.

`add_commands(subparsers)` registers both on the main parser's subparsers; each sets
`handler`, a function of the parsed args returning the exit code (errors are raised as
AttnResError and turned into one line and their exit code by the main CLI).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from ...errors import InputError, first_line


def add_commands(subparsers) -> None:
    """Register `compile` and `run` on `subparsers` (from ArgumentParser.add_subparsers)."""
    comp = subparsers.add_parser("compile", help="compile an AttnRes model (.onnx or .pt2) into a TVM artifact folder")
    comp.add_argument("model", help="rewritten model: MODEL.onnx (attnres-compile rewrite) or MODEL.pt2 (torch.export)")
    comp.add_argument("-o", "--output", required=True, help="artifact folder to write (model.so, manifest.json)")
    comp.add_argument("--target", choices=["llvm", "cuda"], default="llvm",
                      help="llvm: this machine's CPU; cuda: NVIDIA GPUs (builds without one)")
    comp.add_argument("--arch", help="CUDA architecture, e.g. sm_90 (default sm_90; --target cuda only)")
    comp.add_argument("--tune", action="store_true", help="tune the other operators with meta_schedule (CPU, static shapes)")
    comp.add_argument("--trials", type=int, default=8, help="tuning trials per operator (default 8)")
    comp.add_argument("--tuning-db", help="folder keeping tuning records; a later compile reuses them")
    comp.add_argument("--input-shape", action="append", metavar="NAME:1x128",
                      help="fix an input's symbolic dims (repeatable); needed to tune")
    comp.add_argument("--force", action="store_true", help="replace the output folder if it exists")
    comp.set_defaults(handler=compile_command)

    run = subparsers.add_parser("run", help="run a compiled artifact on inputs from an .npz file")
    run.add_argument("artifact", help="artifact folder written by `attnres-compile compile`")
    run.add_argument("--inputs", required=True, help=".npz file with one array per model input, by name")
    run.add_argument("-o", "--output", required=True, help=".npz file to write the outputs to, by name")
    run.set_defaults(handler=run_command)
    for sp in (comp, run):
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")


def compile_command(args) -> int:
    from ..onnxruntime import parse_input_shapes
    from .artifact import compile_model

    # sys.__stderr__: the main CLI hides sys.stderr without --debug; progress stays visible
    manifest = compile_model(args.model, args.output, target=args.target, arch=args.arch, tune=args.tune,
                             trials=args.trials, tuning_db=args.tuning_db,
                             input_shapes=parse_input_shapes(args.input_shape), force=args.force,
                             progress=sys.__stderr__)
    kernels = len(manifest["kernels"])
    print(f"compiled {len(manifest['sites'])} depth-attention sites ({kernels} fused kernels) for "
          f"{manifest['target']['kind']} into {args.output}")
    for io in ("inputs", "outputs"):
        print(f"  {io}: " + ", ".join(f"{x['name']} {x['shape']} {x['dtype']}" for x in manifest[io]))
    if manifest["tuning"]:
        t = manifest["tuning"]
        print(f"  tuning: {t['tuned']} tasks tuned ({t['measured']} trials), {t['reused']} reused from {t['database']}"
              + (f", {t['untunable']} left at the default schedule (no trial ran)" if t.get("untunable") else ""))
    return 0


def run_command(args) -> int:
    import numpy as np

    from .runtime import load

    path = Path(args.inputs)
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as data:
            inputs = {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not an .npz file ({first_line(exc)})") from None
    outputs = load(args.artifact)(inputs)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp.npz")
    os.close(fd)
    try:
        np.savez(tmp, **outputs)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    print("wrote " + str(out) + ": " + ", ".join(f"{k} {list(v.shape)} {v.dtype}" for k, v in outputs.items()))
    return 0
