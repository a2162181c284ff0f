"""`bench model` end to end in its quick configuration (rows, checks, clocks, overhead arithmetic,
memory, profiles, views), the target verdicts, and the worker pool's failure reports."""

from __future__ import annotations

import argparse
import io
import os
import statistics
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from attnres_compile.bench import targets as model_targets, timing  # noqa: E402
from attnres_compile.bench import model  # noqa: E402
from attnres_compile.bench.model import measure, profile, worker as model_worker  # noqa: E402
from attnres_compile.bench.model.worker import WorkerError, Workers  # noqa: E402
from attnres_compile.core.errors import ConfigError  # noqa: E402

QUICK_RUNTIMES = ("eager", "train", "onnxruntime", "tvm")


def _args(out: Path, **overrides) -> argparse.Namespace:
    base = dict(out=str(out), quick=True, device="cpu", threads=2, rounds=2, models=None, sublayers=None,
                runtimes=None, width=None, seq=None, batch=None, blocks=8, trials=None, tune_minutes=None,
                tuning_db=None, profile=True)
    return argparse.Namespace(**{**base, **overrides})


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_model")
    progress = io.StringIO()
    return model.run(_args(out), progress), progress.getvalue(), out


def _row(rows, r, variant):
    return next(o for o in rows if (o["model"], o["width"], o["sublayers"], o["runtime"], o["variant"])
                == (r["model"], r["width"], r["sublayers"], r["runtime"], variant))


def test_every_row_is_there(quick):
    data, _, _ = quick
    (width, depths), = data["config"]["matrices"]
    keys = [(r["model"], r["width"], r["sublayers"], r["runtime"], r["variant"]) for r in data["rows"]]
    expected = {("gpt", width, d, rt, v) for d in depths for rt in QUICK_RUNTIMES for v in measure.VARIANTS}
    assert set(keys) == expected and len(keys) == len(expected)
    assert data["benchmark"] == "model" and data["environment"]["threads"] == 2


def test_rows_are_checked_and_timed_on_both_clocks(quick):
    data, _, _ = quick
    for r in data["rows"]:
        assert r["error"] is None, r
        assert r["max_abs_err"] < 1e-4
        assert r["sites"] == (4 if r["variant"] in ("full", "block") else 0)  # two per layer, every one rewritten
        for clock in ("cpu", "wall"):
            assert 0 < r[f"{clock}_min_ms"] <= r[f"{clock}_ms"]
            assert len(r[f"{clock}_rounds_ms"]) == 2
        # 1 thread: the runtime's work runs in the calling thread, so its CPU time is the process's
        assert r["in_thread"] > 0.95, r
        assert 0 < r["cpu_share"] <= 1.05


def test_overheads_are_paired_round_ratios(quick):
    data, _, _ = quick
    for r in data["rows"]:
        base = _row(data["rows"], r, "original")
        for clock in ("cpu", "wall"):
            ratios = [a / b for a, b in zip(r[f"{clock}_rounds_ms"], base[f"{clock}_rounds_ms"])]
            assert r[f"{clock}_overhead_pct"] == pytest.approx((statistics.median(ratios) - 1) * 100)
        assert (r.get("vs_onnxruntime_cpu") is not None) == (r["runtime"] == "tvm")
        if r["variant"] == "original":
            assert r["cpu_overhead_pct"] == 0 and r["wall_overhead_pct"] == 0


def test_memory_is_measured(quick):
    data, _, _ = quick
    for r in data["rows"]:
        assert r.get("memory_error") is None, r
        assert r["peak_rss_mb"] > 10 and r["forward_peak_mb"] >= 0
    assert any(r["forward_peak_mb"] > 0 for r in data["rows"] if r["variant"] == "original")


def test_profiles_by_kind(quick):
    data, _, _ = quick
    got = {(p["runtime"], p["variant"]): p for p in data["profiles"]}
    assert set(got) == {(rt, v) for rt in ("onnxruntime", "tvm") for v in ("original", "full", "block")}
    for (runtime, variant), p in got.items():
        assert "error" not in p, p
        total = sum(k["ms"] for k in p["kinds"].values())
        assert 0 < total <= p["forward_ms"] * 1.2  # the calls are a part of the forward
        matmuls = sum(k["calls"] for kind, k in p["kinds"].items() if profile.category(kind) == "matmul")
        assert matmuls >= 2 * 4, (runtime, variant)  # qkv, projection and two MLP GEMMs per layer
        if runtime == "tvm":  # fused depth-attention kernels: at least one per site, none in the original
            calls = p["kinds"].get(profile.KERNEL_PREFIX, {"calls": 0})["calls"]
            assert calls == 0 if variant == "original" else calls >= 4


def test_progress_and_targets(quick):
    data, progress, _ = quick
    for stage in ("exporting", "ONNX exported", "TVM compiled, default build", "eager: original", "train: original",
                  "onnxruntime: original", "tvm: original", "peak memory", "profiled"):
        assert stage in progress
    assert len(data["targets"]) == len(model_targets.TARGETS)
    assert all(t["met"] is None and t["note"].startswith("not run") for t in data["targets"])  # width 64 only


def test_table_and_plots(quick):
    data, _, out = quick
    text = model.table(data)
    assert text.splitlines()[0].split()[:5] == ["model", "width", "sublayers", "runtime", "variant"]
    for part in ("1T cpu ovh %", "2T wall ovh %", "identical copy (noise floor)", "calling thread",
                 "overhead over the original: TVM, Block <= +0%", "build time: TVM default build time", "profile gpt 64/4"):
        assert part in text
    paths = model.plot(data, out)
    assert [p.name for p in paths] == ["model_overhead.png", "model_latency.png", "model_vs_onnxruntime.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def _rows(block: dict[tuple[str, int, int], float], runtime="onnxruntime", variant="block") -> list[dict]:
    return [{"model": m, "width": w, "sublayers": d, "runtime": runtime, "variant": variant, "cpu_overhead_pct": v,
             "wall_overhead_pct": v + 1} for (m, w, d), v in block.items()] + [
        {"model": m, "width": w, "sublayers": d, "runtime": runtime, "variant": "copy", "cpu_overhead_pct": 0.5}
        for (m, w, d) in block]


def test_target_verdicts():
    full = {(m, 256, d): 3.0 for m in ("gpt", "llama") for d in (12, 24, 48)}
    verdicts = {(v["name"], v["limit"]): v for v in model_targets.evaluate(_rows({**full, ("llama", 256, 24): 4.5}),
                                                                           [], {"tune_minutes": None, "trials": 0})}
    v = verdicts[("onnxruntime, Block", 5.0)]
    assert (v["measured"], v["beside"], v["met"], v["where"], v["floor"]) == (4.5, 5.5, True, "llama 256/24", 0.5)
    assert v["covered"] == v["expected"] == 6 and v["note"] is None
    assert verdicts[("onnxruntime, Block", 0.0)]["met"] is None  # width 1024 not run
    part = {(v["name"], v["limit"]): v for v in model_targets.evaluate(_rows({("gpt", 256, 12): 12.0}), [], {})}
    v = part[("onnxruntime, Block", 5.0)]
    assert v["met"] is False and v["note"] == "partial: 1 of 6 model configurations run"
    assert "NOT MET" in model_targets.line(v, 2) and "+12.0% 1-thread CPU" in model_targets.line(v, 2)
    builds = [{"model": "gpt", "width": 256, "sublayers": 12, "variant": var, "tvm_build_s": s, "tvm_build_cpu_s": 1.0}
              for var, s in (("original", 20.0), ("full", 75.0))]
    v = next(v for v in model_targets.evaluate([], builds, {}) if v["metric"] == "build_s")
    assert (v["measured"], v["met"], v["where"]) == (75.0, False, "gpt 256/12 full")
    tuned = _rows(full, runtime="tvm-tuned")
    for r in tuned:
        r["vs_onnxruntime_cpu"] = 0.9
    for minutes, met in ((5, None), (20, True)):
        v = next(v for v in model_targets.evaluate(tuned, [], {"tune_minutes": minutes}) if v["runtime"] == "tvm-tuned")
        assert v["met"] is met and v["measured"] == 0.9


def test_verdicts_need_the_interval_clear_of_the_limit():
    """A target is MET only if every configuration's interval (rounds' spread widened by the identical
    copy's overhead) is at or under the limit, NOT MET if one lies wholly above, else WITHIN NOISE."""
    def verdict(value, interval, copy):
        rows = _rows({(m, 256, d): 1.0 for m in ("gpt", "llama") for d in (12, 24, 48)})
        for r in rows:
            if r["variant"] == "copy":
                r["cpu_overhead_pct"] = copy
            elif (r["model"], r["sublayers"]) == ("gpt", 24):
                r.update(cpu_overhead_pct=value, cpu_overhead_interval=interval)
        return next(v for v in model_targets.evaluate(rows, [], {}) if (v["name"], v["limit"]) == ("onnxruntime, Block", 5.0))

    v = verdict(4.0, [2.0, 4.5], 0.4)
    assert (v["met"], v["verdict"], v["band_where"]) == (True, "MET", "gpt 256/24") and v["band"] == pytest.approx([1.6, 4.9])
    v = verdict(4.0, [2.0, 4.5], -0.6)  # the copy's reading widens the band past the limit
    assert (v["met"], v["verdict"]) == (None, "WITHIN NOISE") and v["band"] == pytest.approx([1.4, 5.1])
    assert "within noise: gpt 256/24 reads +1.4% ... +5.1%" in model_targets.line(v, 2)
    assert model_targets.line(v, 2).endswith("WITHIN NOISE")
    v = verdict(7.0, [5.5, 9.0], 0.4)
    assert (v["met"], v["verdict"]) == (False, "NOT MET") and "+5.1% ... +9.4% at gpt 256/24" in model_targets.line(v, 2)
    v = verdict(5.5, [3.0, 8.0], 0.0)  # a median over the limit whose interval holds it decides nothing
    assert (v["met"], v["verdict"], v["measured"]) == (None, "WITHIN NOISE", 5.5)


def test_ratio_interval():
    """Order statistics of the per-round ratios: [min, max] at 5 rounds (93.75%), narrower with more."""
    assert timing.ratio_interval([1, 2, 3, 4, 5], [1] * 5) == (1, 5, 0.9375)
    low, high, coverage = timing.ratio_interval(list(range(1, 22)), [1] * 21)
    assert (low, high) == (7, 15) and 0.9 <= coverage < 0.93
    assert timing.ratio_interval([2.0, 4.0, 6.0], [2.0] * 3)[2] == 0.75  # too few rounds to reach 90%
    assert timing.ratio_interval([3.0], [3.0]) == (1.0, 1.0, 0.0)


def test_side_by_side_lines():
    """Per candidate: median ms, the median ratio to the baseline and its interval (benchmarks' A/B report)."""
    samples = {"new": {"cpu": [0.010, 0.011, 0.009, 0.010, 0.010]}, "old one": {"cpu": [0.011, 0.012, 0.010, 0.0105, 0.011]}}
    new, old = timing.side_by_side(samples, "new")
    assert new == "new        10.00 ms  x1.000  (1.000 .. 1.000, 94%)"
    assert old == "old one    11.00 ms  x1.100  (1.050 .. 1.111, 94%)"


def test_settings(tmp_path):
    assert model.settings(_args(tmp_path, quick=False)).matrices == [(256, [12, 24, 48]), (1024, [24])]
    assert model.settings(_args(tmp_path, quick=False, width=1024, sublayers=[24])).matrices == [(1024, [24])]
    s = model.settings(_args(tmp_path, tune_minutes=20.0))
    assert s.runtimes[-1] == "tvm-tuned" and s.tune_minutes == 20.0
    for bad, match in (({"sublayers": [3]}, "even"), ({"width": 30}, "multiple"),
                       ({"runtimes": ["tvm-tuned"]}, "needs a tuning budget"), ({"tune_minutes": 0.0}, "positive")):
        with pytest.raises(ConfigError, match=match):
            model.settings(_args(tmp_path, **bad))


def test_a_factory_model_is_timed_at_its_own_size(tmp_path):
    """--factory: the user's HF causal LM (here GPT-2 with fused qkv, 2 layers, width 32, vocabulary
    100) replaces the random models; rows and every target are at its own size, ids below its
    vocabulary. A factory that is not an HF causal LM, or a size flag beside it, is one ConfigError."""
    from attnres_compile.cli import main

    args = _args(tmp_path, quick=False, runtimes=["eager"], seq=16, rounds=1, profile=False,
                 factory="samples.hf_decoders:gpt2_factory")
    data = model.run(args, io.StringIO())
    assert {(r["model"], r["width"], r["sublayers"], r["variant"]) for r in data["rows"]} == {
        ("hf_decoders", 32, 4, v) for v in measure.VARIANTS}
    assert all(r["error"] is None and r["max_abs_err"] < 1e-4 for r in data["rows"])
    assert {r["sites"] for r in data["rows"] if r["variant"] in ("full", "block")} == {4}
    eager = next(t for t in data["targets"] if (t["runtime"], t["variant"], t["limit"]) == ("eager", "block", 3.0))
    assert eager["covered"] == eager["expected"] == 1 and "width 32 at 4 sublayers" in eager["target"]
    assert [t["limit"] for t in data["targets"] if (t["runtime"], t["variant"]) == ("eager", "block")] == [3.0]
    with pytest.raises(ConfigError, match="at its own size"):
        model.settings(_args(tmp_path, factory="samples.hf_decoders:gpt2_factory", width=64))
    err = io.StringIO()
    from contextlib import redirect_stderr
    with redirect_stderr(err):
        code = main(["bench", "model", "--factory", "samples.models:gpt_factory", "--runtimes", "eager",
                     "--out", str(tmp_path / "bad")])
    assert code != 0 and "an HF causal LM" in err.getvalue() and "Traceback" not in err.getvalue()
    assert not (tmp_path / "bad").exists()


def test_failed_workers_are_one_line(tmp_path):
    s = model.settings(_args(tmp_path))
    workers = Workers(tmp_path / "logs")
    (tmp_path / "inputs.npz").write_bytes(b"")
    result = measure.memory_fields("onnxruntime", tmp_path / "missing.onnx", {"inputs": tmp_path / "inputs.npz"}, s,
                                 workers)
    assert "\n" not in result["memory_error"] and "Error" in result["memory_error"]
    start = time.perf_counter()
    with pytest.raises(WorkerError, match="timed out after 1 s"):
        workers.run(time.sleep, 30, timeout=1)
    assert time.perf_counter() - start < 20


def test_each_turn_starts_after_a_pause():
    """Every candidate's turn in a round begins `pause` after the previous turn ended, so thread
    pools that spin after a run (onnxruntime's, TVM's) are idle when the next candidate starts."""
    events = []

    def candidate(name):
        def call():
            events.append((name, time.perf_counter()))
        return call

    timing.interleaved_clocks({"a": candidate("a"), "b": candidate("b")}, rounds=2, min_time=0.0, pause=0.03)
    turns = events[2:]  # after the warm-up calls: one call per turn (min_time 0)
    assert [name for name, _ in turns] == ["a", "b", "a", "b"]
    assert min(b - a for (_, a), (_, b) in zip(turns, turns[1:])) >= 0.03


def test_timing_workers_keep_tvm_from_spinning(monkeypatch):
    """A timing worker's TVM pool sleeps when idle: its spinning workers took the cores of
    onnxruntime's original, timed in the same worker, and doubled its 2-thread wall time."""
    import torch

    monkeypatch.delenv("TVM_THREAD_POOL_SPIN_COUNT", raising=False)
    for name in ("TVM_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # restored after the test
    threads = torch.get_num_threads()
    try:
        model_worker.set_threads(2)
    finally:
        torch.set_num_threads(threads)
    assert os.environ["TVM_THREAD_POOL_SPIN_COUNT"] == "0" and os.environ["TVM_NUM_THREADS"] == "2"


def test_results_are_written_with_the_usual_permissions(tmp_path):
    """Tables, JSON and plots get the mode any new file gets (0666 less the umask), not mkstemp's 0600."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attnres_compile.bench import results

    old = os.umask(0o022)
    try:
        text = results.write_text(tmp_path / "a.txt", "x\n")
        figure = results.save_figure(plt.figure(), tmp_path / "a.png")
    finally:
        os.umask(old)
    assert (text.stat().st_mode & 0o777, figure.stat().st_mode & 0o777) == (0o644, 0o644)
