"""`bench decode` end to end through the CLI: the JSON's rows, checks, finite ratios, site costs and target
lines (no timing asserts: the ratios of a busy CI machine are whatever they are). `--quick` (Llama, eager and
onnxruntime, 55 s) runs under -m heavy; CI runs a factory decoder in the same two runtimes."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from attnres_compile.bench.decode import measure as decode  # noqa: E402
from attnres_compile.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_decode")
    assert main(["bench", "decode", "--quick", "--threads", "2", "--out", str(out)]) == 0
    return json.loads((out / "decode.json").read_text()), out


@pytest.mark.heavy
def test_every_row_is_checked_with_finite_ratios(quick):
    data, out = quick
    width, sublayers = decode.QUICK["widths"][0], decode.QUICK["sublayers"][0]
    keys = {(r["model"], r["width"], r["sublayers"], r["runtime"], r["variant"]) for r in data["rows"]}
    expected = {("llama", width, sublayers, rt, v) for rt in decode.QUICK["runtimes"]
                for v in ("original", "copy", "full", "block", *(["hf"] if rt == "eager" else []))}
    assert keys == expected and len(data["rows"]) == len(expected)
    for r in data["rows"]:
        assert r["error"] is None and r["max_abs_err"] < 1e-4, r
        assert r["sites"] == (sublayers if r["variant"] in ("full", "block") else 0)
        for clock in ("cpu", "wall"):
            assert math.isfinite(r[f"{clock}_overhead_pct"]) and r[f"{clock}_token_ms"] > 0
            assert r[f"{clock}_token_ms"] == pytest.approx(r[f"{clock}_ms"] / decode.QUICK["steps"])
    assert {p.name for p in out.iterdir()} >= {"decode.json", "decode.txt", "decode_overhead.png", "decode_latency.png"}


@pytest.mark.heavy
def test_site_costs_and_targets(quick):
    data, out = quick
    site, = data["sites"]
    assert site["add_us"] > 0 and all(us > 0 for us in site["op_us"].values())
    assert set(site["variants"]) == {"full", "block"}
    assert all(len(v["sources"]) == v["sites"] and math.isfinite(v["estimated_overhead_ms"])
               for v in site["variants"].values())
    verdicts = {(t["runtime"], t["variant"]): t["verdict"] for t in data["targets"]}
    assert verdicts == {("tvm", "block"): "not measured", ("onnxruntime", "block"): "not measured",
                        ("eager", "block"): "not measured", ("tvm", "original"): "not measured",
                        ("generate", "block"): "not measured"}
    # the quick matrix has none of the targets' widths and no TVM or generate route
    assert "overhead over the original: onnxruntime decode, Block" in (out / "decode.txt").read_text()


def test_generate_route_candidates_are_checked_and_timed(tmp_path):
    """The generate runtime's job in-process (bench/decode/route.py): HF generate() on the model, an
    identical copy, causal_lm over the trace and over the Block rewrite give the same step logits
    and are timed."""
    import argparse

    import numpy as np

    from attnres_compile.bench.decode import route as decode_route, worker as decode_worker
    from attnres_compile.core.errors import ConfigError

    ids = np.random.default_rng(0).integers(0, 100, (1, 9), dtype=np.int64)
    np.savez(tmp_path / "inputs.npz", input_ids=ids)
    job = {"inputs": str(tmp_path / "inputs.npz"), "prefill": 6, "steps": 3, "model": "llama", "layers": 1,
           "width": 32, "blocks": 8, "factory": None, "rounds": 1, "min_time": 0.0, "threads": 1,
           "candidates": decode_route.candidates()}
    out = decode_worker.time_decode(job)
    assert set(out["samples"]) == {f"generate {v}" for v in decode_route.VARIANTS}
    for name, check in out["checks"].items():
        assert check["error"] is None and check["max_abs_err"] < 1e-4, (name, check)
    with pytest.raises(ConfigError, match="at its own size"):
        decode.settings(argparse.Namespace(factory="samples.smollm2:factory", widths=[256]))


def test_a_factory_decoder_is_timed_in_every_runtime_at_its_own_size(tmp_path):
    """--factory: the user's HF causal LM (Qwen2 with biased q/k/v and grouped-query attention, 2
    layers, width 32, vocabulary 100) is traced, rewritten and timed at its own size in eager (HF's own
    forward beside) and onnxruntime (its files exported with a past), every step's logits checked;
    every target is read there."""
    out = tmp_path / "out"
    assert main(["bench", "decode", "--factory", "samples.hf_decoders:qwen2_factory", "--runtimes", "eager,onnxruntime",
                 "--prefill", "6", "--steps", "3", "--rounds", "1", "--threads", "1", "--out", str(out)]) == 0
    data = json.loads((out / "decode.json").read_text())
    keys = {(r["model"], r["width"], r["sublayers"], r["runtime"], r["variant"]) for r in data["rows"]}
    assert keys == {("hf_decoders", 32, 4, rt, v) for rt in ("eager", "onnxruntime")
                    for v in ("original", "copy", "full", "block", *(["hf"] if rt == "eager" else []))}
    for r in data["rows"]:
        assert r["error"] is None and r["max_abs_err"] < 1e-4, r
        assert math.isfinite(r["cpu_overhead_pct"]) and r["cpu_token_ms"] == pytest.approx(r["cpu_ms"] / 3)
    measured = {(t["runtime"], t["variant"]): t["covered"] for t in data["targets"]}
    assert measured[("eager", "block")] == 1 and measured[("onnxruntime", "block")] == 1
    assert {p.name for p in out.iterdir()} >= {"decode.json", "decode.txt", "decode_overhead.png", "decode_latency.png"}
