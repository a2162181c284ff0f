"""`attnres-compile inspect`: a model's residual chains, sites and skipped adds; with --budget the
pipeline memory plan; with --weights the depth-attention weights of a saved rewritten model."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..core.errors import ConfigError, InputError, cli_words
from ..utils import outputs, progress
from ..utils.factory import load_factory
from ..utils.file_kind import check_file
from ..utils.outputs import Output
from . import args as cli_args
from .args import byte_size, count


def add_command(subparsers) -> None:
    """Register `inspect` on the main parser's subparsers."""
    p = subparsers.add_parser("inspect", help="report residual chains, sites and skipped adds")
    p.add_argument("model", nargs="?", help=cli_args.MODEL_HELP)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--weights", metavar="CHECKPOINT.pt2",
                   help="instead: depth-attention weights of a saved rewritten model (heatmap, collapse flags)")
    p.add_argument("--heatmap", metavar="OUT.png", help="with --weights: where to write the heatmap "
                   "(default: beside the checkpoint, .png)")
    p.add_argument("--force", action="store_true", help="with --weights: overwrite an existing heatmap")
    _budget_args(p)
    cli_args.add_config_args(p, "ONNX input shape for the analysis (repeatable): dims that shape inference cannot "
                                "relate symbolically are compared at these shapes")
    cli_args.add_debug(p)
    p.set_defaults(run=run, outputs=planned_outputs)


def _budget_args(p) -> None:
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
    if args.weights or (args.model and cli_args.is_onnx_path(args.model)):
        raise ConfigError("--budget applies to package.module:factory models: the planner runs the model once in torch "
                          "on its example inputs (one micro-batch)")
    from ..distributed.planner import STAGES_PER_RANK, check_layout

    stages = args.stages or (args.ranks or 2) * STAGES_PER_RANK[args.schedule]
    ranks, micro, _ = check_layout(stages, args.schedule, args.ranks, args.micro_batches, args.optimizer)
    return stages, ranks, micro


def planned_outputs(args) -> tuple[list[Output], list[Path], bool]:
    """(outputs, inputs, force) for outputs.check: the heatmap of --weights; the model and the options
    are checked here, before the command imports torch."""
    if args.model and cli_args.is_onnx_path(args.model):
        check_file(Path(args.model), "an ONNX model")
    if not args.weights:
        cli_args.config(args)
    _budget_layout(args)
    if not args.weights:
        return [], [], False
    checkpoint = Path(args.weights)
    heatmap = Path(args.heatmap) if args.heatmap else checkpoint.with_suffix(".png")
    return [Output(heatmap, "--heatmap")], [checkpoint], args.force


def run(args) -> int:
    if args.weights:
        return _inspect_weights(args)
    if not args.model:
        raise ConfigError("inspect needs MODEL (an .onnx file or package.module:factory) or --weights CHECKPOINT.pt2")
    if cli_args.is_onnx_path(args.model):
        from ..api import inspect_onnx
        from ..onnx.runtime import parse_input_shapes

        cli_args.no_dynamic_for_onnx(args)
        report = inspect_onnx(args.model, cli_args.config(args), parse_input_shapes(args.input_shape))
    else:
        from ..fx.dynamic_dims import parse
        from ..fx.pipeline import inspect_traced
        from ..fx.trace import trace

        cli_args.no_input_shape_for_factory(args)
        parse(args.dynamic)
        layout = _budget_layout(args)
        model, example = load_factory(args.model)
        with progress.stage("tracing"):
            traced = trace(model, example, dynamic=args.dynamic)
        report = inspect_traced(traced, cli_args.config(args))
        if layout:
            from ..distributed.planner import plan_traced

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
    from ..monitor import format_stats, inspect_weights

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
