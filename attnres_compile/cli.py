"""The `attnres-compile` command line: inspect and rewrite PyTorch factories and ONNX files;
compile rewritten ONNX to TVM artifacts and run them (backends/tvm/cli.py).

A model is an ONNX file (a path ending in .onnx, or any existing file) or a
`package.module:factory` returning (model, example_inputs). Every failure is one stderr line
and a documented exit code (docs/cli.md, errors.py); every path a command writes is checked
before any work and written through a staging folder (outputs.py); library log lines, Python
and native, are hidden unless --debug.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import signal
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

from . import __version__, env_checks, outputs, progress
from .cli_args import byte_size, count, factory_file, load_factory, seconds
from .errors import (INTERRUPTED_EXIT, TERMINATED_EXIT, AttnResError, ConfigError, InputError, Interrupted,
                     VerificationError, cli_words, first_line)
from .file_kind import check_file
from .outputs import Output


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line in our format (exit code 2)."""

    def error(self, message: str):
        print(f"attnres-compile: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="attnres-compile", description="Rewrite residual connections into Attention Residuals.")
    p.add_argument("--debug", action="store_true", help="show tracebacks and library log lines")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    model_help = "MODEL.onnx, or package.module:factory (a callable returning (model, example_inputs))"

    ins = sub.add_parser("inspect", help="report residual chains, sites and skipped adds")
    ins.add_argument("model", nargs="?", help=model_help)
    ins.add_argument("--json", action="store_true", help="print the report as JSON")
    ins.add_argument("--weights", metavar="CHECKPOINT.pt2",
                     help="instead: depth-attention weights of a saved rewritten model (heatmap, collapse flags)")
    ins.add_argument("--heatmap", metavar="OUT.png", help="with --weights: where to write the heatmap "
                     "(default: beside the checkpoint, .png)")
    ins.add_argument("--force", action="store_true", help="with --weights: overwrite an existing heatmap")
    _budget_args(ins)
    _config_args(ins)

    rw = sub.add_parser("rewrite", help="rewrite a model to AttnRes and verify it")
    rw.add_argument("model", help=model_help)
    rw.add_argument("-o", "--output", required=True,
                    help="output file: .onnx (ONNX model; from an ONNX file or a factory) or .pt2 (torch.export program)")
    rw.add_argument("--no-verify", action="store_true", help="skip the original-vs-rewritten comparison")
    rw.add_argument("--verify-timeout", type=seconds, metavar="SECONDS",
                    help="time limit of the onnxruntime verification run (default: 120 s plus 120 s per GiB of model)")
    rw.add_argument("--report", help="also write the report as JSON to this file")
    rw.add_argument("--force", action="store_true",
                    help="overwrite existing outputs (-o, its .data, --report); lets -o replace the input")
    rw.add_argument("--with-past", action="store_true",
                    help="factory models (HF causal LMs): rewrite the decoder with its KV cache, for generation "
                         "(past_key_values.* in, logits and present.* out, as optimum names them)")
    _config_args(rw)
    ins.add_argument("--input-shape", action="append", metavar="NAME:1x128",
                     help="ONNX input shape for the analysis (repeatable): dims that shape inference cannot relate "
                          "symbolically are compared at these shapes")
    rw.add_argument("--input-shape", action="append", metavar="NAME:1x128",
                    help="ONNX input shape for the analysis and verification (repeatable); other symbolic dims are "
                         "2 (leading) and 16, then all 1 (a second check); dims that are sums of others are computed")
    for sp in (ins, rw):
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks and library log lines")
    from .backends.tvm.cli import add_commands
    from .bench.cli import add_commands as add_bench_commands
    from .generate_cmd import add_command as add_generate_command

    add_commands(sub)
    add_generate_command(sub)
    add_bench_commands(sub)
    return p


def _budget_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pipeline memory plan (factory models; docs/distributed.md)")
    g.add_argument("--budget", type=byte_size, metavar="SIZE",
                   help="memory per rank (e.g. 40GiB): choose the largest Block N (or Full) aligned with the stage "
                        "cuts whose predicted peak fits, and print each rank's figures; the example inputs are one "
                        "micro-batch")
    g.add_argument("--stages", type=count, help="with --budget: pipeline stages (default: 2 per rank for interleaved/zbv, "
                                                "else one per rank; 2 if neither is given)")
    g.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved", "zbv"], default="1f1b",
                   help="with --budget: torch's pipeline schedule (default 1f1b)")
    g.add_argument("--ranks", type=count, help="with --budget: pipeline ranks (default: stages / stages per rank)")
    g.add_argument("--micro-batches", type=count, metavar="M", help="with --budget: micro-batches per step (default: stages)")
    g.add_argument("--optimizer", choices=["adam", "sgd", "momentum"], default="adam",
                   help="with --budget: optimizer whose state is counted (adam: 2 tensors per parameter; default)")


def _budget_layout(args):
    """(stages, ranks, micro-batches) of `inspect --budget`, checked before any work; a pipeline flag
    without --budget, or --budget where it cannot apply, is one line."""
    given = [f for f, v in (("--stages", args.stages), ("--ranks", args.ranks), ("--micro-batches", args.micro_batches))
             if v is not None]
    if args.budget is None:
        if given:
            raise ConfigError(f"{given[0]} applies with --budget SIZE (the pipeline memory plan)")
        return None
    if args.weights or (args.model and is_onnx_path(args.model)):
        raise ConfigError("--budget applies to package.module:factory models: the planner runs the model once in torch "
                          "on its example inputs (one micro-batch)")
    from .distributed.planner import STAGES_PER_RANK, check_layout

    stages = args.stages or (args.ranks or 2) * STAGES_PER_RANK[args.schedule]
    ranks, micro, _ = check_layout(stages, args.schedule, args.ranks, args.micro_batches, args.optimizer)
    return stages, ranks, micro


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variant", choices=["full", "block"], default="full",
                   help="full: every site attends over all earlier sources (default); block: over block sums")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--blocks", type=int, help="number of blocks N (implies --variant block)")
    g.add_argument("--block-size", type=int, help="sources per block B (implies --variant block)")
    p.add_argument("--scale", choices=["preserve", "paper"], default="preserve",
                   help="preserve: output scaled by |S_k|, exact at init (default); paper: unscaled, as published")
    p.add_argument("--eps", type=float, default=1e-6, help="epsilon of the keys' RMSNorm (default 1e-6)")
    p.add_argument("--min-chain", type=int, default=2, help="shortest chain rewritten, in residual links (default 2)")
    p.add_argument("--feature-axis", type=int,
                   help="axis of the features (default -1, or 1 for rank-4 NCHW streams)")
    p.add_argument("--allow-nonlinear", action="store_true",
                   help="also rewrite post-norm / post-activation streams (changes the function)")
    p.add_argument("--dynamic", metavar="DIMS",
                   help="factory models: input dims the trace keeps dynamic: none, batch, batch,seq (default), all, "
                        "or INPUT.AXIS (e.g. pixel_values.2), comma-separated")


def _config(args):
    from .config import AttnResConfig

    variant = "block" if (args.blocks or args.block_size) else args.variant
    return AttnResConfig(variant=variant, num_blocks=args.blocks, block_size=args.block_size, scale=args.scale,
                         eps=args.eps, min_chain=args.min_chain, feature_axis=args.feature_axis,
                         allow_nonlinear=args.allow_nonlinear)


def is_onnx_path(model: str) -> bool:
    """ONNX file or factory spec: a .onnx name or an existing path that is not a folder is a file."""
    return model.lower().endswith(".onnx") or (os.path.exists(model) and not os.path.isdir(model))


# ---------------------------------------------------------------------------------------------
# what each command writes and reads: checked together before any work (outputs.check)


def _plan_outputs(args) -> tuple[list[Output], list[Path], bool]:
    """(outputs, inputs, force) of the command in `args`, for outputs.check. A missing ONNX input and
    a bad config option are reported here, before the command imports onnx and the passes (~1 s)."""
    model = getattr(args, "model", None)
    if args.command in ("inspect", "rewrite", "compile") and model and is_onnx_path(model):
        check_file(Path(model), "an ONNX model" if args.command != "compile" else "a model file")
    if hasattr(args, "variant") and not getattr(args, "weights", None):
        _config(args)  # its errors (--blocks 0), also before the imports
    if args.command == "inspect":
        _budget_layout(args)
    if args.command == "rewrite":
        out = _rewrite_output(args)
        if is_onnx_path(args.model):
            from .passes import onnx_io

            inputs = onnx_io.files_of(Path(args.model))
        else:
            inputs = [f for f in [factory_file(args.model)] if f]
        if out.suffix.lower() == ".onnx":
            planned = outputs.onnx_outputs(out, "-o")
        else:
            planned = [Output(out, "-o", primary=True)]
        if args.report:
            planned.append(Output(Path(args.report), "--report"))
        return planned, inputs, args.force
    if args.command == "inspect" and args.weights:
        checkpoint = Path(args.weights)
        heatmap = Path(args.heatmap) if args.heatmap else checkpoint.with_suffix(".png")
        return [Output(heatmap, "--heatmap")], [checkpoint], args.force
    if args.command == "compile":
        from .backends.tvm.artifact_checks import artifact_output
        from .passes import onnx_io

        return [artifact_output(Path(args.output))], onnx_io.files_of(Path(args.model)), args.force
    if args.command == "run":
        artifact = Path(args.artifact)
        inputs = [Path(args.inputs), artifact]
        with contextlib.suppress(OSError):
            inputs += [p for p in artifact.rglob("*") if p.is_file()]
        return [Output(Path(args.output), "-o")], inputs, getattr(args, "force", False)
    return [], [], False


# ---------------------------------------------------------------------------------------------
# commands


def _inspect(args) -> int:
    if args.weights:
        return _inspect_weights(args)
    if not args.model:
        raise ConfigError("inspect needs MODEL (an .onnx file or package.module:factory) or --weights CHECKPOINT.pt2")
    if is_onnx_path(args.model):
        from .onnx_api import inspect_onnx

        from .backends.onnxruntime import parse_input_shapes

        _no_dynamic_for_onnx(args)
        report = inspect_onnx(args.model, _config(args), parse_input_shapes(args.input_shape))
    else:
        from .api import inspect_traced, trace
        from .passes.dynamic_dims import parse

        _no_input_shape_for_factory(args)
        parse(args.dynamic)
        layout = _budget_layout(args)
        model, example = load_factory(args.model)
        with progress.stage("tracing"):
            traced = trace(model, example, dynamic=args.dynamic)
        report = inspect_traced(traced, _config(args))
        if layout:
            from .distributed.planner import plan_traced

            stages, ranks, micro = layout
            with progress.stage("profiling one micro-batch"):
                plan = plan_traced(traced, report, args.budget, stages, schedule=args.schedule, ranks=ranks,
                                   micro_batches=micro, optimizer=args.optimizer, num_blocks=args.blocks,
                                   block_size=args.block_size)
            report.data["memory_plan"] = plan.to_dict()
            if not args.json:
                print(cli_words(str(report)) + "\n\n" + plan.table())
                return 0
    print(report.to_json() if args.json else cli_words(str(report)))
    return 0


def _inspect_weights(args) -> int:
    """Per-site depth-attention weights of a saved rewritten model, as a table (or JSON) and a heatmap."""
    from .monitor import format_stats, inspect_weights

    checkpoint = Path(args.weights)
    if not os.path.lexists(checkpoint):  # a FIFO or a folder: pt2.load says what it is
        raise InputError(f"checkpoint {checkpoint} does not exist: pass a .pt2 written by `attnres-compile rewrite -o X.pt2`")
    heatmap = Path(args.heatmap) if args.heatmap else checkpoint.with_suffix(".png")
    with outputs.staged(heatmap) as stage:
        result = inspect_weights(checkpoint, out=stage.path)
    result["heatmap"] = str(heatmap)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(format_stats(result["stats"], result["collapse"]))
        print(f"heatmap: {result['heatmap']}")
    return 0


def _rewrite_output(args) -> Path:
    """-o, checked against the model kind (and --input-shape against it)."""
    onnx_input = is_onnx_path(args.model)
    out = Path(args.output)
    suffixes = (".onnx",) if onnx_input else (".onnx", ".pt2")
    if out.suffix.lower() not in suffixes:
        raise ConfigError(f"output {out} must end in {' or '.join(suffixes)}")
    if not onnx_input:
        _no_input_shape_for_factory(args)
    if args.with_past and (onnx_input or args.dynamic is not None):
        raise ConfigError("--with-past applies to package.module:factory models (HF causal LMs) and sets the dynamic "
                          "dims itself; an ONNX decoder-with-past file is rewritten as it is, without the flag"
                          if onnx_input else "--with-past sets the dynamic dims itself (batch, sequence, past length): "
                          "drop --dynamic")
    if onnx_input:
        _no_dynamic_for_onnx(args)
    else:
        from .passes.dynamic_dims import parse

        parse(args.dynamic)
    return out


def _no_input_shape_for_factory(args) -> None:
    if args.input_shape:
        raise ConfigError("--input-shape applies to ONNX input files; a factory's example inputs fix the shapes")


def _no_dynamic_for_onnx(args) -> None:
    if args.dynamic is not None:
        raise ConfigError("--dynamic applies to package.module:factory models; an ONNX file's dims are the ones it "
                          "declares (--input-shape NAME:1x128 fixes them for the analysis and verification)")


def _rewrite(args) -> int:
    onnx_input = is_onnx_path(args.model)
    out = _rewrite_output(args)
    if onnx_input:
        report, written = _rewrite_onnx(args, out)
    elif out.suffix.lower() == ".onnx":
        report, written = _export_onnx(args, out)
    else:
        report, written = _rewrite_pt2(args, out)
    if args.report:
        done = " and ".join(str(p) for p in written)
        outcome = f"wrote {done}, but not the report" if written else outputs.NOTHING_DONE
        with outputs.staged(args.report, outcome) as stage:
            stage.path.write_text(report.to_json())
    print(cli_words(str(report)))
    print("wrote " + " and ".join(str(p) for p in written) if written else "nothing written")
    failed = [r for r in report["verification"] or [] if r.get("ok") is False]
    if failed and args.scale == "paper":
        from .passes.verify import paper_scale_note

        if paper_scale_note(len(failed)) not in report["notes"]:  # the torch API's report carries it already
            print("note: " + paper_scale_note(len(failed)))
    elif failed:
        from .passes.verify import describe

        message = (f"{args.scale}-mode verification failed on {len(failed)} output(s), e.g. "
                   f"{' '.join(describe(failed[0]).split()[1:])}")
        if "original_export" in failed[0]:
            message += ("; the original model, exported to ONNX the same way, fails that check too "
                        f"({' '.join(failed[0]['original_export'].split()[2:])}): the ONNX export or onnxruntime "
                        "computes this model wrongly, not the rewrite; -o X.pt2 keeps it in PyTorch")
        raise VerificationError(message)
    return 0


def _rewrite_onnx(args, out: Path):
    from .backends.onnxruntime import parse_input_shapes
    from .onnx_api import rewrite_onnx

    shapes = parse_input_shapes(args.input_shape)
    result = rewrite_onnx(args.model, out, _config(args), verify_outputs=not args.no_verify, input_shapes=shapes,
                          force=args.force, verify_timeout=args.verify_timeout)
    return result.report, result.written


def _export_onnx(args, out: Path):
    from .onnx_api import export_onnx

    config = _config(args)
    model, example = load_factory(args.model)
    result = export_onnx(model, example, out, config, verify_outputs=not args.no_verify,
                         verify_timeout=args.verify_timeout, dynamic=args.dynamic, with_past=args.with_past)
    return result.report, result.written


def _rewrite_pt2(args, out: Path):
    from . import pt2
    from .api import rewrite
    from .passes import dynamic_dims
    from .plan_checks import split_inputs

    config = _config(args)
    model, example = load_factory(args.model)
    if args.with_past:
        return _rewrite_pt2_with_past(model, example, config, args, out)
    result = rewrite(model, example, config, verify_outputs=not args.no_verify, dynamic=args.dynamic)
    ex_args, ex_kwargs = split_inputs(example)
    dims = dynamic_dims.parse(args.dynamic)
    spec = dynamic_dims.export_spec(dims, model, ex_args, ex_kwargs) if result.report["dynamic_dims"] else None
    module, tensor_kwargs = pt2.bind_constants(result.graph_module, ex_args, ex_kwargs, like=model)
    if isinstance(spec, dict):  # use_cache=False and other constants are bound, not inputs
        spec = {k: v for k, v in spec.items() if k not in ex_kwargs or k in tensor_kwargs}
    with progress.stage(f"exporting {out.name}"):
        ep = dynamic_dims.export_program(module, ex_args, tensor_kwargs, spec, f"dynamic {dims.text}",
                                         result.report.data["notes"])
        with outputs.staged(out) as stage:
            pt2.save(ep, stage.path, module.constants if isinstance(module, pt2.WithConstants) else None)
    return result.report, stage.written


def _rewrite_pt2_with_past(model, example, config, args, out: Path):
    """The decoder with its KV cache as a .pt2 (decoder.py): the past as separate tensor inputs."""
    from . import pt2
    from .api import _with_past, rewrite
    from .decoder import GENERATION, generation_ids
    from .passes import dynamic_dims

    wrapper, ex_args, spec = _with_past(model, example, None, None)
    result = rewrite(wrapper, ex_args, config, verify_outputs=not args.no_verify, dynamic_shapes=spec)
    with progress.stage(f"exporting {out.name}"):
        ep = dynamic_dims.export_program(result.graph_module, ex_args, {}, (*spec[:3], *spec[3]),
                                         "dynamic batch, sequence and past length", result.report.data["notes"])
        pt2.drop_guards(ep)
        with outputs.staged(out) as stage:
            pt2.save(ep, stage.path, extra={GENERATION: generation_ids(model)})
    return result.report, stage.written


def main(argv: list[str] | None = None) -> int:
    """Run one command; errors become one stderr line and their exit code (with --debug, also the
    traceback and the library log lines). Ctrl-C exits 130, SIGTERM 143, after cleaning up."""
    received = outputs.SIGNALS
    received.clear()
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    try:
        with _signals_as_exceptions(received, debug):
            code = _main(argv, received, debug)
            handled = len(received)
    except (KeyboardInterrupt, Interrupted) as exc:  # a signal after the command, while the handlers are restored
        return _interrupted(received, exc, debug)
    else:
        return _interrupted(received, None, debug) if len(received) > handled else code
    finally:
        received.clear()  # the command is over: later calls in this process may commit again


def _main(argv: list[str] | None, received: list[int], debug: bool) -> int:
    try:
        args = _parser().parse_args(argv)
        command = getattr(args, "handler", None) or {"inspect": _inspect, "rewrite": _rewrite}[args.command]
        with contextlib.nullcontext() if args.debug else _quiet():
            env_checks.check()
            planned, inputs, force = _plan_outputs(args)
            outputs.check(planned, inputs, force)
            with progress.on_terminal():
                code = command(args)
        if not received:
            return code
        raise KeyboardInterrupt  # a signal whose exception a library swallowed: still an interruption
    except BaseException as exc:  # noqa: BLE001 - never a bare traceback without --debug
        if isinstance(exc, SystemExit):  # argparse (--help, usage errors), after its one line
            raise
        if received or isinstance(exc, (KeyboardInterrupt, Interrupted)):
            return _interrupted(received, exc, debug)
        if isinstance(exc, AttnResError):  # one line even when a name from the model holds a newline
            return _fail(debug, cli_words(str(exc)), exc.exit_code)
        if not isinstance(exc, Exception):
            raise
        return _fail(debug, f"{first_line(exc)} (rerun with --debug for the traceback)", 1)


def _interrupted(received: list[int], exc: BaseException, debug: bool) -> int:
    """Exit 143 after SIGTERM, else 130 (Ctrl-C), with one line."""
    term = signal.SIGTERM in received or (isinstance(exc, Interrupted) and signal.SIGINT not in received)
    what, code = ("terminated (SIGTERM)", TERMINATED_EXIT) if term else ("interrupted (Ctrl-C)", INTERRUPTED_EXIT)
    return _fail(debug, f"{what}; no partial output was left", code)


def _fail(debug: bool, message: str, code: int) -> int:
    if debug:
        traceback.print_exc()
    line = f"attnres-compile: error: {' '.join(message.split())}\n"
    if _REAL_STDERR:  # a signal cut _quiet's restore short: fd 2 may still be its scratch file
        os.write(_REAL_STDERR[-1], line.encode())
    else:
        sys.stderr.write(line)
    return code


@contextlib.contextmanager
def _signals_as_exceptions(received: list[int], debug: bool):
    """The first Ctrl-C raises KeyboardInterrupt and SIGTERM Interrupted, so that staging folders
    are removed; later ones are only recorded, so that the cleanup and the error line finish. All
    are recorded in `received` (outputs.SIGNALS, which stops any commit), because an exception
    raised inside a library's callback (a weakref finalizer during garbage collection) can be
    swallowed; Python's "Exception ignored in" report of that is shown only with --debug."""
    armed = True

    def handler(signum, frame):
        first = not received
        received.append(signum)
        if first and armed:
            raise KeyboardInterrupt if signum == signal.SIGINT else Interrupted()

    def unraisable(report):
        if debug:
            previous_hook(report)

    try:
        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    previous_hook, sys.unraisablehook = sys.unraisablehook, unraisable
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # a caller may have blocked them
        yield
    finally:  # disarmed first: a signal while the handlers are put back is recorded (main reports it), not raised
        armed = False
        sys.unraisablehook = previous_hook
        for s, h in previous.items():
            signal.signal(s, h)


_REAL_STDERR: list[int] = []  # the terminal's stderr, duplicated, while _quiet has fd 2 on a scratch file


@contextlib.contextmanager
def _quiet():
    """Keep stderr to the one-line error: library warnings, log lines and partial graphs (Python's
    sys.stderr) and native libraries' lines written to file descriptor 2 (TVM, onnxruntime) go to
    a scratch file that is dropped; progress written to sys.__stderr__ stays visible."""
    import torch  # not for --help and usage errors; its import registers the ops (op_registration.py)

    torch._logging.set_logs(all=logging.CRITICAL)
    sys.stderr.flush()
    saved = os.dup(2)
    _REAL_STDERR.append(saved)
    scratch = tempfile.TemporaryFile()
    real_stderr = sys.__stderr__
    os.dup2(scratch.fileno(), 2)
    sys.__stderr__ = os.fdopen(os.dup(saved), "w", buffering=1)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        with contextlib.suppress(Exception):
            sys.__stderr__.close()
        sys.__stderr__ = real_stderr
        os.dup2(saved, 2)
        _REAL_STDERR.pop()
        os.close(saved)
        scratch.close()
        torch._logging.set_logs()  # back to torch's defaults


if __name__ == "__main__":
    sys.exit(main())
