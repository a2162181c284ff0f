"""Errors with one-line messages that name the problem and what to do about it.
Each class carries its CLI exit code (docs/cli.md). Messages use the Python API's spelling of
options; the CLI prints its own (`cli_words`).
"""

import re


class AttnResError(Exception):
    """Base class: a user-facing failure with a one-line message."""

    exit_code = 1


class ConfigError(AttnResError, ValueError):
    """A bad `AttnResConfig` value or CLI flag."""

    exit_code = 2


class ShardingError(ConfigError, NotImplementedError):
    """A DTensor placement the depth-attention ops cannot compute on (the feature axis sharded).
    Also a NotImplementedError: DTensor's dispatcher passes those on as they are, where it
    rewraps any other error of a sharding rule in a RuntimeError of several lines."""


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
    """The first non-empty line of an exception message, without terminal colour codes, shortened, for one-line errors."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip() or type(exc).__name__
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


class ModelRunError(AttnResError):
    """onnxruntime (or TVM) cannot run the model for verification: it refuses it, an input of its
    type cannot be generated, or a generated input would be absurdly large."""

    exit_code = 15


class CrashError(AttnResError):
    """A library crashed (a signal) while running the model in the isolated child process."""

    exit_code = 16


class TimeLimitError(AttnResError):
    """Running the model in the isolated child took longer than its time limit."""

    exit_code = 17


class MemoryLimitError(AttnResError):
    """Running the model in the isolated child needed more memory than its limit."""

    exit_code = 18


class OutputWriteError(AttnResError):
    """An output could not be written (disk full, I/O error, permission denied); nothing was replaced."""

    exit_code = 19


class UnsafeArchiveError(InputError):
    """A .pt2 archive holds something loading it would execute (pickled objects, code); refused."""

    exit_code = 20


class UnsafeConfigError(InputError):
    """An onnxruntime-genai config names code to load (a custom-op or execution-provider library),
    a place to write (profiling) or an option not known to be data only; refused before og.Model
    sees it (the family of UnsafeArchiveError's 20)."""

    exit_code = 21


class Interrupted(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so that cleanup (`finally`) runs; exit 143."""


INTERRUPTED_EXIT = 130  # Ctrl-C (SIGINT), as shells report it
TERMINATED_EXIT = 143   # SIGTERM

_CLI_WORDS = [
    (r"verify_outputs=False \(--no-verify\)", "--no-verify"),
    (r"\bverify_outputs=False\b", "--no-verify"),
    (r"\ballow_nonlinear=True\b", "--allow-nonlinear"),
    (r"\bwith_past=True\b", "--with-past"),
    (r"\brewrite_chains=False\b", "--no-rewrite"),
    (r"\bweights='(int8|int4)'", r"--weights \1"),
    (r"\beval_ids \(--eval-ids FILE\.npy\)", "--eval-ids FILE.npy"),
    (r"\beval_ids\b", "--eval-ids"),
    (r"\bset variant='block'", "pass --variant block"),
    (r"\bvariant 'block'", "--variant block"),
    (r"\bmin_chain=(\d+)", r"--min-chain \1"),
    (r"\bnum_blocks\b", "--blocks"),
    (r"\bblock_size\b", "--block-size"),
    (r"\bmin_chain\b", "--min-chain"),
    (r"\bfeature_axis\b", "--feature-axis"),
    (r"\ballow_nonlinear\b", "--allow-nonlinear"),
    (r"\binput_shapes\b", "--input-shape"),
    (r"\b(eps|scale|variant|init) must\b", r"--\1 must"),
    (r"\binit='paper'", "--init paper"),
    (r"\bscale='paper'", "--scale paper"),
    (r"\beps=(\S+) is\b", r"--eps \1 is"),
    (r"\b(stages|ranks|micro_batches)=(\S+?)(:| is)", lambda m: f"--{m[1].replace('_', '-')} {m[2]}{m[3]}"),
]


def cli_words(message: str) -> str:
    """`message` with the Python API's option spellings replaced by the CLI's (`--no-verify`)."""
    for pattern, replacement in _CLI_WORDS:
        message = re.sub(pattern, replacement, message)
    return message
