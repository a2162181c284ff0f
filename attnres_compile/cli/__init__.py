"""The `attnres-compile` command line: `main` (program.py) runs one command; parser.py builds the
parser from one module per command (inspect, rewrite, compile, run, generate, bench)."""

from .program import main

__all__ = ["main"]
