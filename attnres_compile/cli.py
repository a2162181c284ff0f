"""The `attnres-compile` command line: inspect and rewrite models.

Exit codes (also in README.md): 0 ok, 1 other error, 2 bad arguments or config, 3 the model
could not be traced, 4 no residual chain, 5 dynamic feature axis, 6 bad input (missing file,
bad factory), 7 preserve-mode verification failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path

from .errors import AttnResError, ConfigError, InputError, VerificationError, first_line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnres-compile", description="Rewrite residual connections into Attention Residuals.")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)

    ins = sub.add_parser("inspect", help="report residual chains, sites and skipped adds")
    ins.add_argument("model", help="package.module:factory (a callable returning (model, example_inputs))")
    ins.add_argument("--json", action="store_true", help="print the report as JSON")
    _config_args(ins)

    rw = sub.add_parser("rewrite", help="rewrite a model to AttnRes and verify it")
    rw.add_argument("model", help="package.module:factory (a callable returning (model, example_inputs))")
    rw.add_argument("-o", "--output", required=True, help="output file (.pt2: a torch.export program)")
    rw.add_argument("--no-verify", action="store_true", help="skip the original-vs-rewritten comparison")
    rw.add_argument("--report", help="also write the report as JSON to this file")
    rw.add_argument("--force", action="store_true", help="overwrite the output if it exists")
    _config_args(rw)
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


def load_factory(spec: str):
    """(model, example_inputs) from `package.module:factory`, importable from the working directory."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InputError(f"model {spec!r} is not of the form package.module:factory")
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
    from .api import inspect

    model, example = load_factory(args.model)
    report = inspect(model, example, _config(args))
    print(report.to_json() if args.json else report)
    return 0


def _rewrite(args) -> int:
    import torch

    from .api import rewrite, _split_inputs

    out = Path(args.output)
    if out.suffix != ".pt2":
        raise ConfigError(f"output {out} must end in .pt2 (a torch.export program)")
    if out.exists() and not args.force:
        raise InputError(f"output {out} exists: pass --force to overwrite it")
    config = _config(args)
    model, example = load_factory(args.model)
    result = rewrite(model, example, config, verify_outputs=not args.no_verify)
    ex_args, ex_kwargs = _split_inputs(example)
    ep = torch.export.export(result.graph_module, ex_args, ex_kwargs, strict=False)
    atomic_write(out, lambda tmp: torch.export.save(ep, str(tmp)))
    if args.report:
        atomic_write(Path(args.report), lambda tmp: tmp.write_text(result.report.to_json()))
    print(result.report)
    print(f"wrote {out}")
    failed = [r for r in result.report["verification"] or [] if r.get("ok") is False]
    if failed:
        raise VerificationError(f"preserve-mode verification failed on {len(failed)} output(s), e.g. {failed[0]['output']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"inspect": _inspect, "rewrite": _rewrite}[args.command](args)
    except AttnResError as exc:
        if args.debug:
            raise
        print(f"attnres-compile: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:  # noqa: BLE001 - never a bare traceback without --debug
        if args.debug:
            raise
        print(f"attnres-compile: error: {first_line(exc)} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
