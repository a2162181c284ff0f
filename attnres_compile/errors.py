"""Errors with one-line messages that name the problem and what to do about it.

Each class carries the CLI exit code documented in README.md, so every front door
(Python API, CLI) reports the same failure the same way.
"""


class AttnResError(Exception):
    """Base class: a user-facing failure with a one-line message."""

    exit_code = 1


class ConfigError(AttnResError, ValueError):
    """A bad `AttnResConfig` value or CLI flag."""

    exit_code = 2


class TraceError(AttnResError):
    """The model could not be traced (the tracer's own reason is included)."""

    exit_code = 3


class NoResidualChainError(AttnResError):
    """The model has no residual chain that can be rewritten."""

    exit_code = 4


class DynamicFeatureAxisError(AttnResError):
    """The feature axis of a chain to rewrite is symbolic; it must be static."""

    exit_code = 5


class InputError(AttnResError):
    """An input file, factory or example input is missing or unusable."""

    exit_code = 6


class VerificationError(AttnResError):
    """Preserve-mode verification found outputs that differ beyond tolerance."""

    exit_code = 7


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first non-empty line of an exception message, shortened, for one-line errors."""
    text = str(exc).strip() or type(exc).__name__
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), text)
    line = f"{type(exc).__name__}: {line}"
    return line if len(line) <= limit else line[: limit - 3] + "..."


class NotOnnxError(InputError):
    """The input file is not an ONNX model (it does not parse as one)."""

    exit_code = 8


class CorruptModelError(InputError):
    """The ONNX model is truncated or damaged (it parses partly, or fails the checker)."""

    exit_code = 9


class ExternalDataError(InputError):
    """A tensor's external data file (`<name>.onnx.data`) is missing or unreadable."""

    exit_code = 10


class OutputPathError(AttnResError):
    """The output path is the input itself, or exists, and --force was not given."""

    exit_code = 11


class UnsupportedOpsetError(InputError):
    """The model's ONNX opset is outside the range the rewrite supports."""

    exit_code = 12


class CompileError(AttnResError):
    """TVM could not import, lower or build the model (the frontend's or compiler's reason is included)."""

    exit_code = 13


class ArtifactError(InputError):
    """A compiled artifact folder is missing, incomplete, or needs a device this machine lacks."""

    exit_code = 14
