"""`attnres-compile rewrite`: a model rewritten to AttnRes, verified, and written as .onnx or .pt2.
MODEL: an ONNX file, a factory, or a saved folder (hf/ship.py: an AttnRes checkpoint keeps its
queries and config; a plain HF causal LM is converted). `--queries` sets a checkpoint's queries
into an ONNX file rewritten from its base model."""

from __future__ import annotations

from pathlib import Path

from ..core.errors import ConfigError, InputError, cli_words
from ..utils import outputs, progress
from ..utils.factory import factory_file, load_factory
from ..utils.file_kind import check_file, folder_kind
from ..utils.outputs import Output
from . import args as cli_args
from .args import seconds


def add_command(subparsers) -> None:
    """Register `rewrite` on the main parser's subparsers."""
    p = subparsers.add_parser("rewrite", help="rewrite a model to AttnRes and verify it")
    p.add_argument("model", help=cli_args.REWRITE_MODEL_HELP)
    p.add_argument("-o", "--output", required=True,
                   help="output file: .onnx (ONNX model; from any MODEL) or .pt2 (torch.export program; from a factory "
                        "or a folder)")
    p.add_argument("--no-verify", action="store_true", help="skip the original-vs-rewritten comparison")
    p.add_argument("--no-rewrite", action="store_true",
                   help="write the model as it is, traced, exported and verified by the same machinery (no site): "
                        "the original to compare a rewrite with (compile builds it too)")
    p.add_argument("--weights", choices=["int8", "int4"],
                   help=".onnx output: MatMul weights quantized (onnxruntime MatMulNBits, blocks of 32, symmetric; sites, "
                        "norms and embeddings float32), verified against the float32 model within stated bounds "
                        "(perplexity, next-token agreement; docs/quantize.md)")
    p.add_argument("--eval-ids", metavar="FILE.npy",
                   help="token ids [rows, tokens] of real text to verify --weights on (default: a factory's example "
                        "input_ids; needed for an ONNX input)")
    p.add_argument("--verify-timeout", type=seconds, metavar="SECONDS",
                   help="time limit of the onnxruntime verification run (default: 120 s plus 120 s per GiB of model)")
    p.add_argument("--report", help="also write the report as JSON to this file")
    p.add_argument("--force", action="store_true",
                   help="overwrite existing outputs (-o, its .data, --report); lets -o replace the input")
    p.add_argument("--with-past", action="store_true",
                   help="factories and folders (HF causal LMs): rewrite the decoder with its KV cache, for generation "
                        "(past_key_values.* in, logits and present.* out, as optimum names them)")
    p.add_argument("--queries", metavar="CHECKPOINT_DIR",
                   help="ONNX input: set the rewritten sites' pseudo-queries to those of this AttnRes checkpoint "
                        "(save_pretrained of a converted model; its AttnRes config is used), matched by chain and site "
                        "index and size: an onnxruntime-genai folder of the base model then serves the trained one")
    cli_args.add_config_args(p, "ONNX input shape for the analysis and verification (repeatable); other symbolic dims "
                                "are 2 (leading) and 16, then all 1 (a second check); dims that are sums of others are "
                                "computed")
    cli_args.add_debug(p)
    p.set_defaults(run=run, outputs=planned_outputs)


def planned_outputs(args) -> tuple[list[Output], list[Path], bool]:
    """(outputs, inputs, force) for outputs.check: -o (with its .data), --report; the model file's checks
    and the options first, before the command imports onnx and torch."""
    kind = cli_args.model_kind(args.model)
    if kind == "onnx":
        check_file(Path(args.model), "an ONNX model")
    cli_args.config(args)
    out = _output(args, kind)
    if kind == "onnx":
        from ..onnx import io as onnx_io

        inputs = onnx_io.files_of(Path(args.model))
    elif kind == "factory":
        inputs = [f for f in [factory_file(args.model)] if f]
    else:  # a folder: -o must not replace any file in it
        inputs = sorted(p for p in Path(args.model).iterdir() if p.is_file())
    planned = outputs.onnx_outputs(out, "-o") if out.suffix.lower() == ".onnx" else [Output(out, "-o", primary=True)]
    if args.report:
        planned.append(Output(Path(args.report), "--report"))
    return planned, inputs, args.force


def _output(args, kind: str) -> Path:
    """-o, checked against the model kind (and --input-shape, --dynamic, --with-past, --queries against it)."""
    onnx_input = kind == "onnx"
    out = Path(args.output)
    suffixes = (".onnx",) if onnx_input else (".onnx", ".pt2")
    if out.suffix.lower() not in suffixes:
        raise ConfigError(f"output {out} must end in {' or '.join(suffixes)}")
    if args.queries is not None:
        if args.no_rewrite:
            raise ConfigError("--queries sets the pseudo-queries of rewritten sites and --no-rewrite writes none: "
                              "drop one of them")
        if not onnx_input:
            raise ConfigError("--queries applies to ONNX input files (an onnxruntime-genai folder's model.onnx); a "
                              "saved AttnRes checkpoint folder as MODEL is exported with its own queries")
        if not Path(args.queries).is_dir() or folder_kind(args.queries) != "attnres":
            raise InputError(f"--queries {args.queries}: not an AttnRes checkpoint folder (save_pretrained of a "
                             "model converted by attnres_compile.convert; its config.json has an 'attnres' section)")
    if not onnx_input:
        cli_args.no_input_shape_for_factory(args)
    if args.with_past and (onnx_input or args.dynamic is not None):
        raise ConfigError("--with-past applies to package.module:factory models and saved folders (HF causal LMs) "
                          "and sets the dynamic dims itself; an ONNX decoder-with-past file is rewritten as it is, "
                          "without the flag"
                          if onnx_input else "--with-past sets the dynamic dims itself (batch, sequence, past length): "
                          "drop --dynamic")
    if (args.weights or args.eval_ids) and out.suffix.lower() != ".onnx":
        raise ConfigError("--weights writes an .onnx file (onnxruntime's MatMulNBits); -o must end in .onnx")
    if args.eval_ids and not args.weights:
        raise ConfigError("--eval-ids verifies --weights: give --weights int8 or int4")
    if args.eval_ids:
        check_file(Path(args.eval_ids), "a .npy array of token ids")
    if onnx_input:
        cli_args.no_dynamic_for_onnx(args)
    else:
        from ..fx.dynamic_dims import parse

        parse(args.dynamic)
    return out


def run(args) -> int:
    from .. import api

    kind = cli_args.model_kind(args.model)
    out = _output(args, kind)
    config = cli_args.config(args)
    quantize = {}
    if args.weights:
        from ..onnx.weights import read_eval_ids

        quantize = {"weights": args.weights, "eval_ids": read_eval_ids(args.eval_ids) if args.eval_ids else None}
    if kind == "onnx":
        from ..onnx.runtime import parse_input_shapes

        result = api.rewrite_onnx(args.model, out, config if args.queries is None or cli_args.options_given(args)
                                  else None, verify_outputs=not args.no_verify,
                                  input_shapes=parse_input_shapes(args.input_shape), force=args.force,
                                  verify_timeout=args.verify_timeout, queries=args.queries,
                                  rewrite_chains=not args.no_rewrite, **quantize)
    else:
        if kind == "factory":
            model, example = load_factory(args.model)
        else:
            model, example, config = _folder(args, config)
        if out.suffix.lower() == ".onnx":
            result = api.export_onnx(model, example, out, config, verify_outputs=not args.no_verify,
                                     verify_timeout=args.verify_timeout, dynamic=args.dynamic, with_past=args.with_past,
                                     rewrite_chains=not args.no_rewrite, **quantize)
        else:
            result = api.export_pt2(model, example, out, config, verify_outputs=not args.no_verify,
                                    dynamic=args.dynamic, with_past=args.with_past, rewrite_chains=not args.no_rewrite)
    report, written = result.report, result.written
    if args.report:
        done = " and ".join(str(p) for p in written)
        outcome = f"wrote {done}, but not the report" if written else outputs.NOTHING_DONE
        with outputs.staged(args.report, outcome) as stage:
            stage.path.write_text(report.to_json())
    print(cli_words(str(report)))
    print("wrote " + " and ".join(str(p) for p in written) if written else "nothing written")
    _judge(report, "preserve" if args.no_rewrite else args.scale)
    return 0


def _folder(args, config):
    """(model, example inputs, config) of a saved folder: an AttnRes checkpoint with its trained queries
    and its own config (other AttnRes options refused), or a Hugging Face causal LM, converted with
    `config` as a factory's model is."""
    from ..hf import ship

    with progress.stage(f"loading {Path(args.model).name}"):
        model, converted = ship.load_folder(args.model)
    example = None if args.with_past else ship.example_inputs(model)
    if converted:
        saved, _ = ship.queries(model)
        config = ship.config_for(saved, config if cli_args.options_given(args) else None, args.model)
    return model, example, config


def _judge(report, scale: str) -> None:
    """A failed verification was refused before writing (core/verify.refuse_failed); in paper mode a
    note: the rewrite changes the function by design."""
    from ..core.verify import paper_scale_note

    failed = [r for r in report["verification"] or [] if r.get("ok") is False]
    if failed and scale == "paper" and paper_scale_note(len(failed)) not in report["notes"]:
        print("note: " + paper_scale_note(len(failed)))  # the torch API's report carries it already
