"""The `attnres-compile` command line: inspect and rewrite PyTorch factories and ONNX files;
compile rewritten ONNX to TVM artifacts and run them (backends/tvm/cli.py).

A model is an ONNX file (a path ending in .onnx, or any existing file) or a
`package.module:factory` returning (model, example_inputs). Exit codes (docs/cli.md):
0 ok, 1 other error, 2 bad arguments or config, 3 the model could not be traced, 4 no residual
chain, 5 dynamic feature axis, 6 bad input (missing file, bad factory, output exists without
--force), 7 preserve-mode verification failed, 8 not an ONNX file, 9 truncated or corrupt ONNX
model, 10 external data missing, truncated, malformed or outside the model's folder (refused, never
read), 11 output would replace the input or its data (without --force), 12 unsupported ONNX opset,
13 TVM import, lowering or build failed, 14 not a usable TVM artifact folder.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import logging
import os
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

from .errors import AttnResError, ConfigError, InputError, VerificationError, first_line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnres-compile", description="Rewrite residual connections into Attention Residuals.")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)
    model_help = "MODEL.onnx, or package.module:factory (a callable returning (model, example_inputs))"

    ins = sub.add_parser("inspect", help="report residual chains, sites and skipped adds")
    ins.add_argument("model", nargs="?", help=model_help)
    ins.add_argument("--json", action="store_true", help="print the report as JSON")
    ins.add_argument("--weights", metavar="CHECKPOINT.pt2",
                     help="instead: depth-attention weights of a saved rewritten model (heatmap, collapse flags)")
    ins.add_argument("--heatmap", metavar="OUT.png", help="with --weights: where to write the heatmap "
                     "(default: beside the checkpoint, .png)")
    _config_args(ins)

    rw = sub.add_parser("rewrite", help="rewrite a model to AttnRes and verify it")
    rw.add_argument("model", help=model_help)
    rw.add_argument("-o", "--output", required=True,
                    help="output file: .onnx (ONNX model; from an ONNX file or a factory) or .pt2 (torch.export program)")
    rw.add_argument("--no-verify", action="store_true", help="skip the original-vs-rewritten comparison")
    rw.add_argument("--report", help="also write the report as JSON to this file")
    rw.add_argument("--force", action="store_true", help="overwrite the output if it exists, even if it is the input")
    rw.add_argument("--input-shape", action="append", metavar="NAME:1x128",
                    help="ONNX input shape for verification (repeatable); symbolic dims default to 2 (leading) and 16")
    _config_args(rw)
    for sp in (ins, rw):
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    from .backends.tvm.cli import add_commands
    from .bench.cli import add_commands as add_bench_commands

    add_commands(sub)
    add_bench_commands(sub)
    return p


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variant", choices=["full", "block"], default="full")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--blocks", type=int, help="number of blocks N (variant block)")
    g.add_argument("--block-size", type=int, help="sources per block B (variant block)")
    p.add_argument("--scale", choices=["preserve", "paper"], default="preserve")
    p.add_argument("--eps", type=float, default=1e-6)
    p.add_argument("--min-chain", type=int, default=2)
    p.add_argument("--feature-axis", type=int)
    p.add_argument("--allow-nonlinear", action="store_true",
                   help="also rewrite post-norm / post-activation streams (changes the function)")


def _config(args):
    from .config import AttnResConfig

    variant = "block" if (args.blocks or args.block_size) else args.variant
    return AttnResConfig(variant=variant, num_blocks=args.blocks, block_size=args.block_size, scale=args.scale,
                         eps=args.eps, min_chain=args.min_chain, feature_axis=args.feature_axis,
                         allow_nonlinear=args.allow_nonlinear)


def is_onnx_path(model: str) -> bool:
    """ONNX file or factory spec: a .onnx name or an existing file is a file."""
    return model.lower().endswith(".onnx") or os.path.isfile(model)


def load_factory(spec: str):
    """(model, example_inputs) from `package.module:factory`, importable from the working directory."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InputError(f"model {spec!r} is neither an existing file nor of the form package.module:factory")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise InputError(f"cannot load factory {spec!r}: {first_line(exc)}") from None
    try:
        made = factory()
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"factory {spec!r} raised {first_line(exc)}") from None
    if not (isinstance(made, tuple) and len(made) == 2):
        raise InputError(f"factory {spec!r} must return (model, example_inputs), got {type(made).__name__}")
    return made


def atomic_write(path: Path, write) -> None:
    """Call `write(tmp_path)` on a temporary file beside `path`, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _inspect(args) -> int:
    if args.weights:
        return _inspect_weights(args)
    if not args.model:
        raise ConfigError("inspect needs MODEL (an .onnx file or package.module:factory) or --weights CHECKPOINT.pt2")
    if is_onnx_path(args.model):
        from .onnx_api import inspect_onnx

        report = inspect_onnx(args.model, _config(args))
    else:
        from .api import inspect

        model, example = load_factory(args.model)
        report = inspect(model, example, _config(args))
    print(report.to_json() if args.json else report)
    return 0


def _inspect_weights(args) -> int:
    """Per-site depth-attention weights of a saved rewritten model, as a table (or JSON) and a heatmap."""
    from .monitor import format_stats, inspect_weights

    checkpoint = Path(args.weights)
    if not checkpoint.is_file():
        raise InputError(f"checkpoint {checkpoint} does not exist: pass a .pt2 written by `attnres-compile rewrite -o X.pt2`")
    result = inspect_weights(checkpoint, out=args.heatmap or checkpoint.with_suffix(".png"))
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(format_stats(result["stats"], result["collapse"]))
        print(f"heatmap: {result['heatmap']}")
    return 0


def _check_output(args, suffixes: tuple[str, ...]) -> Path:
    """The output path, with a known suffix; an existing one is refused without --force
    (for ONNX input files rewrite_onnx checks, first, that the output is not the input)."""
    out = Path(args.output)
    if out.suffix.lower() not in suffixes:
        raise ConfigError(f"output {out} must end in {' or '.join(suffixes)}")
    if not is_onnx_path(args.model) and out.exists() and not args.force:
        raise InputError(f"output {out} exists: pass --force to overwrite it")
    return out


def _rewrite(args) -> int:
    onnx_input = is_onnx_path(args.model)
    out = _check_output(args, (".onnx",) if onnx_input else (".onnx", ".pt2"))
    if args.input_shape and not onnx_input:
        raise ConfigError("--input-shape applies to ONNX input files; a factory's example inputs fix the shapes")
    if onnx_input:
        report, written = _rewrite_onnx(args, out)
    elif out.suffix.lower() == ".onnx":
        report, written = _export_onnx(args, out)
    else:
        report, written = _rewrite_pt2(args, out)
    if args.report:
        atomic_write(Path(args.report), lambda tmp: tmp.write_text(report.to_json()))
    print(report)
    print("wrote " + " and ".join(str(p) for p in written) if written else "nothing written")
    failed = [r for r in report["verification"] or [] if r.get("ok") is False]
    if failed and args.scale == "paper":
        print(f"note: paper scale differs from the original on {len(failed)} output(s); it is exact only up to the "
              "norms' eps on PreNorm models (not an error)")
    elif failed:
        raise VerificationError(f"{args.scale}-mode verification failed on {len(failed)} output(s), e.g. {failed[0]['output']} "
                                f"(max abs {failed[0].get('max_abs', float('nan')):.2e}, tol {failed[0].get('tol', float('nan')):.1e})")
    return 0


def _rewrite_onnx(args, out: Path):
    from .backends.onnxruntime import parse_input_shapes
    from .onnx_api import rewrite_onnx

    shapes = parse_input_shapes(args.input_shape)
    result = rewrite_onnx(args.model, out, _config(args), verify_outputs=not args.no_verify, input_shapes=shapes,
                          force=args.force)
    return result.report, result.written


def _export_onnx(args, out: Path):
    from .onnx_api import export_onnx

    config = _config(args)
    model, example = load_factory(args.model)
    result = export_onnx(model, example, out, config, verify_outputs=not args.no_verify)
    return result.report, result.written


def _rewrite_pt2(args, out: Path):
    import torch

    from .api import rewrite
    from .plan_checks import split_inputs

    config = _config(args)
    model, example = load_factory(args.model)
    result = rewrite(model, example, config, verify_outputs=not args.no_verify)
    ex_args, ex_kwargs = split_inputs(example)
    ep = torch.export.export(result.graph_module, ex_args, ex_kwargs, strict=False)
    atomic_write(out, lambda tmp: torch.export.save(ep, str(tmp)))
    return result.report, [out]


def main(argv: list[str] | None = None) -> int:
    """Run one command; errors become one stderr line and their exit code (with --debug, also the traceback)."""
    args = _parser().parse_args(argv)
    command = getattr(args, "handler", None) or {"inspect": _inspect, "rewrite": _rewrite}[args.command]
    try:
        with contextlib.nullcontext() if args.debug else _quiet():
            return command(args)
    except Exception as exc:  # noqa: BLE001 - never a bare traceback without --debug
        if args.debug:
            traceback.print_exc()
        if isinstance(exc, AttnResError):  # one line even when a name from the model holds a newline
            print(f"attnres-compile: error: {' '.join(str(exc).split())}", file=sys.stderr)
            return exc.exit_code
        print(f"attnres-compile: error: {first_line(exc)} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1


@contextlib.contextmanager
def _quiet():
    """Keep stderr to the one-line error: library warnings, log lines and partial graphs
    (torch.export prints one on failure) only with --debug."""
    import torch

    torch._logging.set_logs(all=logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        torch._logging.set_logs()  # back to torch's defaults


if __name__ == "__main__":
    sys.exit(main())
