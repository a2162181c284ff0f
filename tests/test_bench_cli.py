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


# ---------------------------------------------------------------------------------------------
# issue 62 item 5: every --out checked with the other outputs before any work, written staged


@pytest.fixture
def no_benchmark(monkeypatch):
    """The kernel benchmark replaced by a stand-in that records whether it ran and writes one plot."""
    import attnres_compile.bench.kernel as kernel

    ran = []

    def plot(data, out_dir):
        path = out_dir / data.get("plot", "kernel_bandwidth.png")
        path.write_bytes(b"\x89PNG")
        return [path]

    monkeypatch.setattr(kernel, "run", lambda args, progress: ran.append(args) or {"rows": [], **RESULT})
    monkeypatch.setattr(kernel, "table", lambda data: "a table")
    monkeypatch.setattr(kernel, "plot", plot)
    return ran


RESULT: dict = {}


def test_an_out_that_is_a_file_is_refused_before_any_work(no_benchmark, tmp_path, capsys):
    """`bench kernel --quick --out EXISTING_FILE` ran the whole benchmark (two minutes), then failed with
    FileExistsError, exit 1, the results lost."""
    out = tmp_path / "results"
    out.write_text("mine")
    assert main(["bench", "kernel", "--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--out {out} is a file" in err[0], err
    assert not no_benchmark and out.read_text() == "mine"


def test_existing_results_are_replaced_only_with_force(no_benchmark, tmp_path, capsys):
    out = tmp_path / "results"
    out.mkdir()
    (out / "kernel.json").write_text("old")
    assert main(["bench", "kernel", "--quick", "--out", str(out)]) == 6
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kernel.json exists: pass --force" in err[0], err
    assert not no_benchmark and (out / "kernel.json").read_text() == "old"
    assert main(["bench", "kernel", "--quick", "--out", str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["kernel.json", "kernel.txt", "kernel_bandwidth.png"]
    assert (out / "kernel.txt").read_text() == "a table\n"


def test_a_fifo_among_the_results_is_refused_even_with_force(no_benchmark, tmp_path, capsys):
    import os

    out = tmp_path / "results"
    out.mkdir()
    os.mkfifo(out / "kernel.txt")
    assert main(["bench", "kernel", "--quick", "--out", str(out), "--force"]) == 2
    assert "FIFO" in capsys.readouterr().err and not no_benchmark


def test_results_commit_together_or_not_at_all(no_benchmark, tmp_path, capsys, monkeypatch):
    """A plot the command did not declare is a bug: nothing of that benchmark is committed."""
    monkeypatch.setitem(RESULT, "plot", "surprise.png")
    out = tmp_path / "results"
    assert main(["bench", "kernel", "--quick", "--out", str(out)]) == 1
    assert "surprise.png" in capsys.readouterr().err
    assert not out.exists() or not list(out.iterdir())


def test_every_plot_a_benchmark_writes_is_declared():
    """The names `bench` checks before any work (cli/bench.py RESULTS) cover every PNG the benchmarks write."""
    import re
    from pathlib import Path

    from attnres_compile.cli.bench import RESULTS

    root = Path(__file__).resolve().parents[1] / "attnres_compile" / "bench"
    declared = {name for names in RESULTS.values() for name in names}
    for path in root.rglob("*.py"):
        for name in re.findall(r'"([a-z_{}]+\.png)"', path.read_text()):
            expanded = [name.replace("{prefix}", p) for p in ("kernel", "kernel_backward")] if "{" in name else [name]
            assert set(expanded) <= declared, (path.name, name)


# ---------------------------------------------------------------------------------------------
# issue 62 item 9: a bench --factory runs in an isolated child with time and memory limits

HANG = "import time\n\ndef f():\n    time.sleep(10**6)\n"
HOG = "import torch\n\ndef f():\n    return torch.ones(2**31, dtype=torch.uint8), None\n"


@pytest.mark.parametrize("bench", ["model", "decode"])
def test_a_factory_that_never_returns_is_stopped(tmp_path, bench):
    """A --factory whose function never returns hung `bench` (the factory ran in-process)."""
    from forked_cli import run_cli

    (tmp_path / "hang.py").write_text(HANG)
    run = run_cli(["bench", bench, "--factory", "hang:f", "--runtimes", "eager", "--factory-timeout", "3",
                   "--out", tmp_path / "out"], cwd=tmp_path, timeout=60)
    errors = [line for line in run.lines if line.startswith("attnres-compile: error: ")]  # after progress lines
    assert run.code == 17 and len(errors) == 1 and errors[0] == run.lines[-1], (run.code, run.signal, run.stderr)
    assert "--factory hang:f did not finish within 3 s" in errors[0] and not (tmp_path / "out").exists()


def test_a_factory_past_the_memory_limit_is_stopped(tmp_path):
    from forked_cli import run_cli

    (tmp_path / "hog.py").write_text(HOG)
    run = run_cli(["bench", "model", "--factory", "hog:f", "--runtimes", "eager", "--out", tmp_path / "out"],
                  cwd=tmp_path, timeout=60, env={"ATTNRES_COMPILE_MEMORY_LIMIT": "512M"})
    errors = [line for line in run.lines if line.startswith("attnres-compile: error: ")]
    assert run.code == 18 and len(errors) == 1 and "ran out of memory" in errors[0], (run.code, run.stderr)
