"""`attnres-compile bench` flag handling: bad values give one-line errors and exit 2, before any work."""

from __future__ import annotations

import pytest
import torch

from attnres_compile.cli import main


@pytest.mark.parametrize("argv, message", [
    (["bench", "kernel", "--threads", "0"], "--threads must be a positive integer"),
    (["bench", "kernel", "--rounds", "0"], "--rounds must be a positive integer"),
    (["bench", "model", "--sublayers", "13", "--runtimes", "eager"], "--sublayers must be even"),
    (["bench", "model", "--width", "30", "--runtimes", "eager"], "--width must be a multiple of 4"),
    (["bench", "model", "--tune-minutes", "0"], "--tune-minutes must be positive"),
    (["bench", "model", "--runtimes", "tvm,tvm-tuned"], "--runtimes tvm-tuned needs a tuning budget"),
    (["bench", "all", "--sublayers", "13"], "--sublayers must be even"),  # before the kernel benchmark starts
    (["bench", "decode", "--sublayers", "13"], "--sublayers must be even"),
    (["bench", "decode", "--widths", "30"], "--widths must be multiples of 4"),
])
def test_bad_values_are_one_line_errors(argv, message, tmp_path, capsys):
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.parametrize("argv", [["bench", "kernel", "--sources", "2,x"], ["bench", "kernel", "--rows", "0"],
                                  ["bench", "kernel", "--backends", "tvm,cuda"], ["bench", "model", "--models", "bert"],
                                  ["bench", "model", "--runtimes", "eager,jax"]])
def test_bad_lists_are_rejected_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "expected" in err and "comma-separated" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu(tmp_path, capsys):
    assert main(["bench", "block", "--device", "cuda", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("attnres-compile: error: --device cuda: torch sees no CUDA GPU here; "
                   "run on a GPU machine or drop --device cuda")
