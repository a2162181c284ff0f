"""`attnres_compile.bench.kernel`: the kernel benchmark on tiny shapes, its arithmetic, memory
guard, targets, table and plots, and one run through `attnres-compile bench kernel --quick`."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("tvm")
pytest.importorskip("onnxruntime")
from attnres_compile.bench import kernel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def args(**overrides) -> argparse.Namespace:
    base = dict(sources=None, rows=None, features=None, dtypes=None, backends=None, passes=None, quick=True,
                device="cpu", threads=1, rounds=1)
    return argparse.Namespace(**{**base, **overrides})


@pytest.fixture(scope="module")
def tiny():
    """fp32 and fp16, two source counts, two row counts (one not a multiple of anything)."""
    a = args(sources=[2, 5], rows=[64, 100], features=[32], dtypes=["float32", "float16"],
             backends=["tvm", "eager", "op", "onnxruntime"])
    return kernel.run(a, sys.stderr)


def test_rows_have_every_backend_timed_and_correct(tiny):
    """A forward and a backward row per shape; the backward has no onnxruntime, and the fused
    backward's query gradient is checked too."""
    assert tiny["benchmark"] == "kernel" and tiny["environment"]["threads"] == 1
    assert [r["pass"] for r in tiny["rows"]] == ["forward", "backward"] * (2 * 2 * 2)
    assert tiny["copy_bandwidth_GBps"] > 0
    for row in tiny["rows"]:
        expected = {"tvm", "eager", "op", "onnxruntime"} if row["pass"] == "forward" else {"tvm", "eager", "op"}
        assert set(row["backends"]) == expected
        for name, e in row["backends"].items():
            assert e["median_ms"] > 0 and 0 < e["min_ms"] <= e["median_ms"]
            bound = 5e-3 if name == "eager" and row["dtype"] == "float16" else kernel.TOLERANCE[row["dtype"]]
            assert 0 <= e["max_rel_err"] <= bound, (name, row)
        if row["pass"] == "backward":
            assert 0 <= row["backends"]["tvm"]["max_rel_err_query"] <= kernel.TOLERANCE[row["dtype"]]


def test_bytes_bandwidth_and_speedup_arithmetic(tiny):
    for row in tiny["rows"]:
        itemsize = 4 if row["dtype"] == "float32" else 2
        tensors = row["S"] + 1 if row["pass"] == "forward" else 2 * row["S"] + 1  # backward: sources, g, grads
        assert row["bytes"] == tensors * row["T"] * row["D"] * itemsize
        tvm_ms = row["backends"]["tvm"]["median_ms"]
        for name, e in row["backends"].items():
            assert e["GBps"] == pytest.approx(row["bytes"] / (e["median_ms"] * 1e-3) / 1e9)
            assert e["fraction_of_copy"] == pytest.approx(e["GBps"] / row["copy_GBps"])
            if name != "tvm":
                assert row["tvm_speedup"][name] == pytest.approx(e["median_ms"] / tvm_ms)


def test_setup_is_paid_once_per_group(tiny):
    """One TVM build (per pass) and one onnxruntime session per (S, D, dtype), reused for every T."""
    for row in tiny["rows"]:
        first = row["T"] == 64
        for name in ("tvm", "onnxruntime") if row["pass"] == "forward" else ("tvm",):
            assert ("setup_s" in row["backends"][name]) == first
        assert "setup_s" not in row["backends"]["eager"]
    assert tiny["targets"] == []  # the target shape is not in this matrix


def test_compile_once_for_every_row_count():
    """torch.compile with the rows marked dynamic: one graph serves both T."""
    from torch._dynamo.utils import counters

    counters.clear()
    data = kernel.run(args(sources=[3], rows=[16, 40], features=[16], backends=["tvm", "compile"], passes=["forward"]),
                      sys.stderr)
    assert counters["stats"]["unique_graphs"] == 1
    first, second = data["rows"]
    assert first["backends"]["compile"]["setup_s"] > 0 and "setup_s" not in second["backends"]["compile"]
    assert all(r["backends"]["compile"]["max_rel_err"] < 1e-4 for r in data["rows"])


def test_wrong_kernel_raises(monkeypatch):
    monkeypatch.setitem(kernel.TOLERANCE, "float32", 0.0)
    with pytest.raises(AssertionError, match="tvm is wrong"):
        kernel.run(args(sources=[3], rows=[16], features=[16], backends=["tvm"]), sys.stderr)


def test_memory_guard_skips_shapes_and_backends(monkeypatch):
    # S=2, T=64, D=32 float32: sources + output 24576 bytes; eager another 4 * 16384 * 4
    assert kernel.memory_plan(2, 64, 32, "float32", ["tvm"], 24575)[0].startswith("sources and output need")
    reason, skipped = kernel.memory_plan(2, 64, 32, "float32", list(kernel.BACKENDS), 50_000)
    assert reason is None and set(skipped) == {"eager", "compile", "onnxruntime"}

    # the backward: sources, g and gradients 40960 bytes; eager's autograd another 5 * 16384
    assert kernel.memory_plan(2, 64, 32, "float32", ["tvm"], 40959, "backward")[0].startswith("sources, g and")
    assert set(kernel.memory_plan(2, 64, 32, "float32", ["tvm", "eager"], 50_000, "backward")[1]) == {"eager"}

    a = args(sources=[2], rows=[64], features=[32], backends=["tvm", "eager", "onnxruntime"], passes=["forward"])
    monkeypatch.setattr(kernel, "available_bytes", lambda device: 50_000 / kernel.MEMORY_FRACTION)
    (row,) = kernel.run(a, sys.stderr)["rows"]
    assert row["backends"]["tvm"]["median_ms"] > 0
    assert "estimated peak" in row["backends"]["eager"]["skipped"] and "median_ms" not in row["backends"]["eager"]
    assert "tvm_speedup" in row and "eager" not in row["tvm_speedup"]

    monkeypatch.setattr(kernel, "available_bytes", lambda device: 1000)
    (row,) = kernel.run(a, sys.stderr)["rows"]
    assert "skipped" in row and "backends" not in row


def fake_data(tvm_ms: float, fraction: float) -> dict:
    """A measured target-shape row, a row with a skipped backend and a skipped shape."""
    def entry(ms, frac=None):
        return {"median_ms": ms, "min_ms": ms, "GBps": 1.0, "fraction_of_copy": frac or 0.05, "max_rel_err": 1e-7}

    target = {**kernel.TARGET_SHAPE, "bytes": 1, "copy_GBps": 20.0,
              "backends": {"tvm": entry(tvm_ms, fraction), "eager": entry(75.0), "op": entry(7.0),
                           "compile": entry(24.0), "onnxruntime": entry(10.0)},
              "tvm_speedup": {"eager": 75.0 / tvm_ms, "op": 7.0 / tvm_ms, "compile": 24.0 / tvm_ms,
                              "onnxruntime": 10.0 / tvm_ms}}
    partial = {"S": 5, "T": 2048, "D": 1024, "dtype": "float16", "bytes": 1, "copy_GBps": 20.0,
               "backends": {"tvm": {**entry(1.0, 0.5), "setup_s": 0.3}, "eager": {"skipped": "estimated peak 9 GB"},
                            "compile": entry(3.0), "onnxruntime": entry(4.0)},
               "tvm_speedup": {"compile": 3.0, "onnxruntime": 4.0}}
    skipped = {"S": 33, "T": 8192, "D": 4096, "dtype": "float32", "skipped": "sources and output need 4.9 GB"}
    backward = {**kernel.TARGET_SHAPE, "pass": "backward", "bytes": 1, "copy_GBps": 20.0,
                "backends": {"tvm": entry(tvm_ms, fraction), "eager": entry(75.0), "op": entry(7.0),
                             "compile": entry(24.0)},
                "tvm_speedup": {"eager": 75.0 / tvm_ms, "op": 7.0 / tvm_ms, "compile": 24.0 / tvm_ms}}
    rows = [target, partial, skipped, backward]
    return {"benchmark": "kernel", "environment": {"device": "cpu"},
            "config": {"backends": list(kernel.BACKENDS), "dtypes": ["float32", "float16"],
                       "passes": list(kernel.PASSES)},
            "rows": rows, "targets": kernel.targets(rows)}


def test_targets_table_and_plots(tmp_path):
    met = fake_data(tvm_ms=2.0, fraction=0.7)
    assert [t["met"] for t in met["targets"]] == [True, True, True, True]
    assert met["targets"][0]["measured"] == pytest.approx(37.5)
    assert met["targets"][3]["name"] == "tvm backward fraction of copy bandwidth"
    missed = fake_data(tvm_ms=10.0, fraction=0.2)
    assert [t["met"] for t in missed["targets"]] == [False, False, False, False]

    text = kernel.table(missed)
    assert "NOT MET" in text and "S=33 T=8192 D=4096 float32: skipped" in text
    assert "eager skipped, estimated peak 9 GB" in text and "set-up seconds" in text
    assert "met)" in kernel.table(met)

    assert "backward: median ms per call" in kernel.table(met)
    paths = kernel.plot(met, tmp_path)
    assert sorted(p.name for p in paths) == ["kernel_backward_bandwidth.png", "kernel_backward_speedup.png",
                                             "kernel_bandwidth.png", "kernel_speedup.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


@pytest.mark.heavy
def test_cli_quick(tmp_path):
    """The CLI over every backend, torch.compile's cold backward included (50 s of CI): `tiny` and
    test_compile_once_for_every_row_count run the same code in process."""
    proc = subprocess.run([sys.executable, "-m", "attnres_compile.cli", "bench", "kernel", "--quick", "--sources", "9",
                           "--threads", "1", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "kernel.json").read_text())
    assert {b for r in data["rows"] for b in r["backends"]} == set(kernel.BACKENDS)
    backward = [r for r in data["rows"] if r["pass"] == "backward"]
    assert backward and all(set(r["backends"]) == set(kernel.BACKWARD_BACKENDS) for r in backward)
    assert "backward: median ms per call" in (tmp_path / "kernel.txt").read_text()
    assert (tmp_path / "kernel_bandwidth.png").stat().st_size > 0
    assert (tmp_path / "kernel_backward_bandwidth.png").stat().st_size > 0


def test_cuda_path_builds_without_a_gpu(monkeypatch):
    """The --device cuda set-up up to the device call: a TVM build for the GPU's arch, and
    onnxruntime without its CUDA provider recorded as skipped."""
    import onnxruntime as ort

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    for backward in (False, True):
        module = kernel._tvm_build(3, 64, "float16", "cuda", 1, backward=backward)
        assert [m.kind for m in module.mod.imports] == ["cuda"]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        assert "CUDAExecutionProvider" in kernel._unavailable(["onnxruntime"], "cuda")["onnxruntime"]
