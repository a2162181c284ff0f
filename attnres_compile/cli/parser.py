"""The argument parser: global flags, and one subcommand per module of this package. Each command
module's `add_command` registers its parser with `run(args) -> exit code` and `outputs(args) ->
(outputs, inputs, force)`, what it writes and reads, checked before any work (utils/outputs.py)."""

from __future__ import annotations

import argparse
import sys

from ..core import __version__
from . import bench, compile, generate, inspect, rewrite, run

COMMANDS = (inspect, rewrite, compile, run, generate, bench)


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line in our format (exit code 2)."""

    def error(self, message: str):
        print(f"attnres-compile: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


def build() -> argparse.ArgumentParser:
    """The whole command line; importing it costs no torch, onnx or TVM."""
    p = Parser(prog="attnres-compile", description="Rewrite residual connections into Attention Residuals.")
    p.add_argument("--debug", action="store_true", help="show tracebacks and library log lines")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_command(sub)
    return p
