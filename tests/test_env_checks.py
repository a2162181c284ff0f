"""Environment variables with unusable values stop a run at its start, in one line with exit 2
(issue 39 item 17): ATTNRES_KERNEL=garbage failed with exit 1 after tracing, a memory limit of
99999999T was reported as a crash of the child (16), and a limit of 0 silently ran with none."""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from forked_cli import run_cli  # noqa: E402
from hostile import tiny  # noqa: E402


@pytest.mark.parametrize("env, words", [
    ({"ATTNRES_KERNEL": "garbage"}, "ATTNRES_KERNEL='garbage' is not a depth-attention kernel: use one of auto"),
    ({"ATTNRES_COMPILE_MEMORY_LIMIT": "99999999T"}, "ATTNRES_COMPILE_MEMORY_LIMIT='99999999T' is more than 1 EiB"),
    ({"ATTNRES_COMPILE_MEMORY_LIMIT": "0"}, "ATTNRES_COMPILE_MEMORY_LIMIT='0' is less than a byte"),
])
def test_a_bad_environment_is_one_line_before_any_work(tmp_path, env, words):
    onnx.save(tiny(), tmp_path / "m.onnx")
    run = run_cli(["rewrite", tmp_path / "m.onnx", "-o", tmp_path / "out.onnx"], env=env)
    assert run.code == 2, (run.code, run.signal, run.stderr)
    assert len(run.lines) == 1 and run.lines[0].startswith("attnres-compile: error: ") and words in run.lines[0], run.lines
    assert not (tmp_path / "out.onnx").exists()

