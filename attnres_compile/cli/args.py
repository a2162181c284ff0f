"""What the command line's arguments are: argparse types (seconds, a size in bytes, a count), the
rewrite options every command that rewrites shares, and whether MODEL names an ONNX file."""

from __future__ import annotations

import argparse
import os
import re

from ..core.errors import ConfigError


def seconds(text: str) -> float:
    """A positive, finite number of seconds (an argparse type)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$")


def byte_size(text: str) -> int:
    """A positive number of bytes: 40GiB, 512 MiB, 1.5GB (decimal), 1e9 (an argparse type)."""
    match = _SIZE.match(text.lower())
    value = float(match.group(1)) * _UNITS[match.group(2)] if match and match.group(2) in _UNITS else 0
    if not 1 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a size such as 40GiB, 512MiB or 1.5GB, got {text!r}")
    return int(value)


def count(text: str) -> int:
    """A whole number of at least 1 (an argparse type)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


MODEL_HELP = "MODEL.onnx, or package.module:factory (a callable returning (model, example_inputs))"
REWRITE_MODEL_HELP = ("MODEL.onnx, a saved model folder (an AttnRes checkpoint: exported with its trained queries; or "
                      "a Hugging Face causal LM: converted), or package.module:factory (a callable returning "
                      "(model, example_inputs))")


def is_onnx_path(model: str) -> bool:
    """ONNX file or factory spec: a .onnx name or an existing path that is not a folder is a file."""
    return model.lower().endswith(".onnx") or (os.path.exists(model) and not os.path.isdir(model))


def model_kind(model: str) -> str:
    """What MODEL names: "onnx" (a file), "attnres" (a saved AttnRes checkpoint folder), "hf" (a saved
    Hugging Face model folder) or "factory"; a folder that is neither checkpoint is InputError (one
    line). Reads config.json only: no import of torch, nothing from the folder run."""
    if os.path.isdir(model) and not model.lower().endswith(".onnx"):  # x.onnx/ is refused as an ONNX input
        from ..utils.file_kind import folder_kind

        return folder_kind(model)
    return "onnx" if is_onnx_path(model) else "factory"


def options_given(args) -> bool:
    """Whether any AttnRes option differs from its default (a checkpoint brings its own config)."""
    from ..core.config import AttnResConfig

    return config(args) != AttnResConfig()


def add_config_args(p: argparse.ArgumentParser, input_shape_help: str) -> None:
    """The rewrite's options (AttnResConfig's fields), --dynamic (factories) and --input-shape (ONNX files), on `p`."""
    p.add_argument("--variant", choices=["full", "block", "delta"], default="full",
                   help="full: every site attends over all earlier sources (default); block: over block sums; delta: "
                        "Delta AttnRes, the plain stream kept and a gated mix added to what reads it")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--blocks", type=int, help="number of blocks N (implies --variant block unless --variant delta: "
                   "Delta-Block)")
    g.add_argument("--block-size", type=int, help="sources per block B (as --blocks)")
    p.add_argument("--init", choices=["exact", "paper"], default="exact",
                   help="--variant delta: gates start at 0, exact (default), or at 1, the published form")
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
    p.add_argument("--input-shape", action="append", metavar="NAME:1x128", help=input_shape_help)


def config(args):
    """The AttnResConfig the options of `args` describe (its errors before any heavy import)."""
    from ..core.config import AttnResConfig

    variant = "block" if (args.blocks or args.block_size) and args.variant != "delta" else args.variant
    return AttnResConfig(variant=variant, num_blocks=args.blocks, block_size=args.block_size, scale=args.scale,
                         eps=args.eps, min_chain=args.min_chain, feature_axis=args.feature_axis,
                         allow_nonlinear=args.allow_nonlinear, init=getattr(args, "init", "exact"))


def add_debug(p: argparse.ArgumentParser) -> None:
    """--debug on a subcommand too (`attnres-compile rewrite ... --debug`)."""
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks and library log lines")


def no_input_shape_for_factory(args) -> None:
    if args.input_shape:
        raise ConfigError("--input-shape applies to ONNX input files; a factory's example inputs fix the shapes")


def no_dynamic_for_onnx(args) -> None:
    if args.dynamic is not None:
        raise ConfigError("--dynamic applies to package.module:factory models; an ONNX file's dims are the ones it "
                          "declares (--input-shape NAME:1x128 fixes them for the analysis and verification)")


def no_outputs(args) -> tuple[list, list, bool]:
    """`outputs` of a command that writes no file."""
    return [], [], False
