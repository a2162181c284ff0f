"""`attnres-compile compile`: a rewritten .onnx or .pt2 built into a TVM artifact folder, verified
against its source first (backends/tvm)."""

from __future__ import annotations

import sys
from pathlib import Path

from ..utils import isolate, outputs, progress
from ..utils.file_kind import check_file
from ..utils.outputs import Output
from . import args as cli_args
from .args import seconds


def add_command(subparsers) -> None:
    """Register `compile` on the main parser's subparsers."""
    comp = subparsers.add_parser("compile", help="compile an AttnRes model (.onnx or .pt2) into a TVM artifact folder")
    comp.add_argument("model", help="rewritten model: MODEL.onnx (attnres-compile rewrite) or MODEL.pt2 (torch.export); "
                                    "a model without sites is built as it is (the original, to compare with)")
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
    comp.add_argument("--prefill", action="append", metavar="BATCHxLENGTH",
                      help="a decoder with past: also build a library for prompts of BATCH rows and up to LENGTH "
                           "tokens with an empty past (repeatable; e.g. 1x128): a faster prefill, at the cost of the "
                           "weights stored once more")
    comp.add_argument("--decode", action="append", metavar="BATCH",
                      help="a decoder with past: also build a library for one-token steps of BATCH rows, any past "
                           "(repeatable; e.g. 1): a faster decode, at the cost of the weights stored once more")
    comp.add_argument("--force", action="store_true", help="replace the output folder if it exists")
    comp.add_argument("--no-verify", action="store_true",
                      help="skip running the compiled model against its source (onnxruntime, or torch on a .pt2's "
                           "example inputs)")
    comp.add_argument("--verify-timeout", type=seconds, metavar="SECONDS",
                      help="time limit of the onnxruntime reference run (default: 120 s plus 120 s per GiB of model)")
    cli_args.add_debug(comp)
    comp.set_defaults(run=compile_command, outputs=planned_outputs)


def planned_outputs(args) -> tuple[list[Output], list[Path], bool]:
    """(outputs, inputs, force) for outputs.check: the artifact folder; the model file and what it reads."""
    check_file(Path(args.model), "a model file")
    from ..backends.tvm.artifact_checks import artifact_output
    from ..onnx import io as onnx_io

    return [artifact_output(Path(args.output))], onnx_io.files_of(Path(args.model)), args.force


def compile_command(args) -> int:
    from ..backends.tvm import fixed_shapes
    from ..backends.tvm.artifact import compile_model
    from ..onnx.dims import describe as describe_shapes
    from ..onnx.runtime import parse_input_shapes

    # sys.__stderr__: the main CLI hides sys.stderr without --debug; progress stays visible.
    # In an isolated child (isolate.py): TVM's importers and builder run the user's graph and can crash.
    prefill, decode = fixed_shapes.parse(args.prefill, args.decode)
    try:
        tune = args.tune or args.trials is not None or args.tune_minutes is not None
        with progress.stage(f"compiling {Path(args.model).name} for {args.target}" + (", tuning" if tune else ""),
                            lines_follow=tune):  # tuning prints a line per task
            manifest = isolate.run(compile_model, args.model, args.output, target=args.target, arch=args.arch,
                                   tune=tune, trials=args.trials, tune_minutes=args.tune_minutes, tuning_db=args.tuning_db,
                                   input_shapes=parse_input_shapes(args.input_shape),
                                   static_shapes=parse_input_shapes(args.static_shape, "--static-shape"), force=args.force,
                                   prefill=prefill, decode=decode,
                                   progress=sys.__stderr__, verify_outputs=not args.no_verify,
                                   verify_timeout=args.verify_timeout, what="TVM", action="compiling", timeout=None,
                                   consequence="nothing written")
    finally:
        outputs.clean_stale(Path(args.output))  # the staging folder of a child that crashed
    kernels = len(manifest["kernels"])
    if manifest.get("rewritten") is False:
        print(f"compiled the original model (no depth-attention sites, not rewritten) for {manifest['target']['kind']} "
              f"into {args.output}, by the same pipeline as a rewritten one")
    else:
        print(f"compiled {len(manifest['sites'])} depth-attention sites ({kernels} fused kernels) for "
              f"{manifest['target']['kind']} into {args.output}")
    for io in ("inputs", "outputs"):
        print(f"  {io}: " + ", ".join(f"{x['name']} {x['dtype']}[{dims(x['shape'])}]" for x in manifest[io]))
    check = manifest.get("verification")
    if check and "skipped" in check:
        print(f"  not verified: {check['skipped']}")
    elif check:
        from ..core.verify import describe as describe_row  # torch: after the compile, not for the parser
        from ..core.verify import nothing_compared

        shapes = "; ".join(describe_shapes(s) for s in check.get("verified_shapes") or [check["inputs"]])
        empty = nothing_compared(check["rows"])
        print(f"  not verified against {check['reference']} at {shapes}: {empty}" if empty else
              f"  verified against {check['reference']} at {shapes}:")
        for row in check["rows"]:
            print(f"    {describe_row(row)}" + (f"  at {row['at']}" if row.get("at") else ""))
        for note in check.get("notes", []):
            print(f"  note: {note}")
    for kind in fixed_shapes.KINDS:
        for entry in manifest.get(kind.KEY, []):
            print(f"  {entry['library']}: {fixed_shapes.from_entry(kind, entry).what} "
                  f"({entry['library_size'] / 2**20:.0f} MiB)" + _fixed_check(entry.get("verification")))
    if manifest["tuning"]:
        t = manifest["tuning"]
        gain = f"; tuned operators {t['best_us']:.0f} us vs {t['default_us']:.0f} us default" if t.get("best_us") else ""
        print(f"  tuning: {t['tuned']} tasks tuned ({t['measured']} trials), {t['reused']} reused from {t['database']}"
              + (f", {t['untunable']} left at the default schedule (no trial ran)" if t.get("untunable") else "")
              + gain)
    return 0


def _fixed_check(check: dict | None) -> str:
    if not check:
        return "; not verified"
    if "skipped" in check:
        return f"; not verified: {check['skipped']}"
    worst = max((r.get("min_rtol", 0.0) for r in check["rows"]), default=0.0)
    run = (f"a {check['tokens']}-token prompt, padded" if not check["past"]
           else f"{check['tokens']} token after a past of {check['past']}")
    return f"; verified against {check['reference']} at {run}: largest error {worst:.1e} of an output's largest magnitude"


def dims(shape) -> str:
    """A shape as `1, 128` or `batch, seq` (symbolic dims by name; `?` unknown), not a Python list."""
    if shape is None:
        return "?"
    return ", ".join("?" if d is None else str(d) for d in shape)
