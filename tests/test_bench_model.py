"""`bench model` end to end in its quick configuration: rows, checks, overhead arithmetic, targets, views."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from attnres_compile.bench import model  # noqa: E402
from attnres_compile.errors import ConfigError  # noqa: E402


def _args(out: Path, **overrides) -> argparse.Namespace:
    base = dict(out=str(out), quick=True, device="cpu", threads=2, rounds=2, models=None, sublayers=None,
                runtimes=None, width=None, seq=None, batch=None, blocks=8, trials=None, tuning_db=None)
    return argparse.Namespace(**{**base, **overrides})


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_model")
    progress = io.StringIO()
    return model.run(_args(out), progress), progress.getvalue(), out


def test_every_row_is_there(quick):
    data, _, _ = quick
    cfg = data["config"]
    keys = {(r["model"], r["sublayers"], r["runtime"], r["variant"]) for r in data["rows"]}
    expected = {(m, d, rt, v) for m in cfg["models"] for d in cfg["sublayers"]
                for rt in model.RUNTIMES for v in model.VARIANTS}
    assert keys == expected and len(data["rows"]) == len(expected)
    assert data["benchmark"] == "model" and data["environment"]["threads"] == 2


def test_rows_are_checked_and_timed(quick):
    data, _, _ = quick
    for r in data["rows"]:
        assert r["error"] is None, r
        assert r["median_ms"] > 0 and 0 < r["min_ms"] <= r["median_ms"]
        assert r["max_abs_err"] < 1e-4
        assert r["sites"] == (0 if r["variant"] == "original" else 12)  # two per layer, every one rewritten


def test_overhead_follows_from_latencies(quick):
    data, _, _ = quick
    rows = data["rows"]
    for r in rows:
        base = next(o for o in rows if (o["model"], o["sublayers"], o["runtime"], o["variant"])
                    == (r["model"], r["sublayers"], r["runtime"], "original"))
        assert r["overhead_pct"] == pytest.approx((r["median_ms"] / base["median_ms"] - 1) * 100)


def test_memory_is_measured(quick):
    data, _, _ = quick
    for r in data["rows"]:
        assert r.get("memory_error") is None, r
        assert r["peak_rss_mb"] > 10 and r["forward_peak_mb"] >= 0
    assert any(r["forward_peak_mb"] > 0 for r in data["rows"] if r["variant"] == "original")


def test_targets_and_progress(quick):
    data, progress, _ = quick
    targets = {t["name"]: t for t in data["targets"]}
    assert set(targets) == {f"Block latency overhead in {rt}" for rt in model.TARGET_RUNTIMES}
    for runtime in model.TARGET_RUNTIMES:
        t = targets[f"Block latency overhead in {runtime}"]
        block = [r["overhead_pct"] for r in data["rows"] if r["runtime"] == runtime and r["variant"] == "block"]
        assert t["measured"] == max(block) and t["met"] == (max(block) <= model.TARGET_PCT)
    for stage in ("exporting", "ONNX exported", "TVM compiled", "eager:", "onnxruntime:", "tvm:", "peak memory"):
        assert stage in progress


def test_table_and_plots(quick):
    data, _, out = quick
    text = model.table(data)
    assert text.splitlines()[0].split()[:4] == ["model", "sublayers", "runtime", "variant"]
    assert "overhead %" in text and "target: Block latency overhead in tvm" in text
    paths = model.plot(data, out)
    assert [p.name for p in paths] == ["model_overhead.png", "model_latency.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_bad_settings_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="even"):
        model.settings(_args(tmp_path, sublayers=[3]))
    with pytest.raises(ConfigError, match="multiple"):
        model.settings(_args(tmp_path, width=30))


def test_failed_worker_is_recorded(tmp_path):
    s = model.settings(_args(tmp_path))
    bogus = tmp_path / "missing.onnx"
    (tmp_path / "inputs.npz").write_bytes(b"")
    result = model.measure_memory("onnxruntime", bogus, tmp_path / "inputs.npz", s)
    assert result["memory_error"].startswith("worker exited")
