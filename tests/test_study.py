"""samples/study.py at its --tiny size: every arm of every seed at every size, finite losses, the exact
preserve conversion (step-0 loss equal to the baseline's within 1e-5), the sweep, summary and plots; and
`--parts scratch` (the from-scratch arms only, Delta's with their gates starting at 1)."""

import json
import math
import os

import pytest
import torch

from samples import study, study_report
from samples.study_arms import CONVERTED, FROM_SCRATCH


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    threads, env = torch.get_num_threads(), os.environ.get("ATTNRES_KERNEL")
    results = study.main(["--tiny", "--kernel", "eager", "--out", str(out)])  # eager: no TVM kernel builds in CI
    assert (torch.get_num_threads(), os.environ.get("ATTNRES_KERNEL")) == (threads, env)  # the process is left as it was
    return out, results


def test_all_arms_and_seeds(tiny):
    out, results = tiny
    saved = json.loads((out / "results.json").read_text())
    cfg = saved["config"]
    assert sorted(saved["runs"], key=int) == [str(L) for L in cfg["sizes"]] and len(cfg["sizes"]) >= 2
    for L, runs in saved["runs"].items():
        assert sorted(runs) == [str(s) for s in range(cfg["seeds"])] and cfg["seeds"] >= 3
        for seed, arms in runs.items():
            ratios = saved["cost"][L]["ratio_used"]
            costed = [f"{ref}@{v}-cost" for v, r in ratios.items() for ref, steps in (("baseline", cfg["steps"]), ("continue", cfg["ft_steps"]))
                      if round(steps * r) != steps and (ref == "baseline" or v in study.VARIANTS)]
            assert set(arms) == set(study.SCRATCH) | set(study.CONVERT) | set(costed)
            for name, rec in arms.items():
                assert math.isfinite(rec["final"]) and all(math.isfinite(loss) for _, loss in rec["curve"])
                assert rec["curve"][0][0] == 0 and rec["curve"][-1][0] == rec["steps"]
            for name in costed:
                ref, v = name.split("@")[0], name.split("@")[1].removesuffix("-cost")
                assert arms[name]["steps"] == round(cfg["steps" if ref == "baseline" else "ft_steps"] * ratios[v])
    assert results["runs"].keys() == saved["runs"].keys()


def test_conversion_is_exact_at_step_zero(tiny):
    _, results = tiny
    for runs in results["runs"].values():
        for arms in runs.values():
            base = arms["baseline"]["final"]  # the trained baseline, on the same validation batches
            assert arms["continue"]["start_loss"] == base
            for name in ("full-preserve", "block-preserve"):
                assert abs(arms[name]["start_loss"] - base) <= 1e-5
            for name in ("full-paper", "block-paper"):  # eps only: close, not asserted equal
                assert abs(arms[name]["start_loss"] - base) < 0.05


def test_sweep_analysis_and_outputs(tiny):
    out, results = tiny
    sweep = results["sweep"]
    lrs = results["config"]["sweep_lrs"]
    assert sorted((r["variant"], r["query_lr"]) for r in sweep["runs"]) == sorted((v, lr) for v in study.VARIANTS for lr in lrs)
    assert sweep["chosen"] == results["query_lr"] > 0
    control = [r["final"] for r in sweep["runs"] if r["query_lr"] == 0 and r["variant"] == "full"]
    assert control[0] == pytest.approx(sweep["continue"], abs=1e-5)  # uniform weights: the baseline's function
    for L, an in results["analysis"].items():
        kinds = {(c["arm"], c["kind"]) for c in an["comparisons"]}
        assert {(a, k) for a in CONVERTED + FROM_SCRATCH for k in ("equal steps", "equal compute")} <= kinds
        assert all(len(c["diffs"]) == results["config"]["seeds"] and c["ci95"][0] <= c["mean"] <= c["ci95"][1]
                   for c in an["comparisons"])
        assert all(an["conversion_check"][a] <= 1e-5 for a in ("full-preserve", "block-preserve"))
    summary = (out / "summary.md").read_text()
    assert "**Answer (from scratch" in summary and "**Answer (conversion)" in summary
    assert "## What this does and does not show" in summary
    for L in results["analysis"]:
        assert (out / f"weights_{L}.png").stat().st_size > 0
    for name in ("curves_scratch", "curves_convert", "entropy", "magnitude"):
        assert (out / f"{name}.png").stat().st_size > 0


def test_summary_is_generated_from_results_json(tiny, tmp_path):
    out, _ = tiny
    saved = json.loads((out / "results.json").read_text())
    assert study_report.summary_markdown(saved, study_report.analyze(saved)) == (out / "summary.md").read_text()
    with pytest.raises(SystemExit, match="run the study first"):
        study.main(["--report-only", "--out", str(tmp_path)])


def test_scratch_part_only(tmp_path):
    results = study.main(["--tiny", "--kernel", "eager", "--parts", "scratch", "--sizes", "2", "--seeds", "2", "--out", str(tmp_path)])
    arms = results["runs"]["2"]["0"]
    assert set(arms) == set(study.SCRATCH) | {f"baseline@{v}-cost" for v, r in results["cost"]["2"]["ratio_used"].items()
                                              if round(results["config"]["steps"] * r) != results["config"]["steps"]}
    assert results["sweep"] is None and results["query_lr"] is None
    assert len(arms["delta"]["gates"]) == 4 and len(arms["delta-block"]["gates"]) == 4  # one per sublayer site
    calls = results["cost"]["2"]["per_step"]
    assert calls["baseline"]["calls"] == {"fused": 0, "eager": 0} and all(calls[a]["calls"]["eager"] > 0 for a in FROM_SCRATCH)
    summary = (tmp_path / "summary.md").read_text()
    assert "**Answer (from scratch" in summary and "Answer (conversion)" not in summary and "arXiv 2605.18855" in summary
    assert not (tmp_path / "curves_convert.png").exists()


def test_delta_arms_start_at_the_paper_init():
    args = study.parse_args(["--tiny"])
    cfg, state = study.cfg_of(args), study.build_model(0, len(study.load_text()[2]), 2, args.dim, args.heads, args.seq).state_dict()
    for variant in ("delta", "delta-block"):
        gm, _ = study.instantiate(cfg, 2, variant, "paper", state)
        gates = [p.item() for n, p in gm.named_parameters() if ".gate" in n]
        assert gates and all(g == 1.0 for g in gates)
        assert all(not p.any() for n, p in gm.named_parameters() if ".site" in n)  # pseudo-queries 0


def test_bad_flags_exit_with_one_line(capsys, tmp_path):
    for argv in (["--sizes", "8,x"], ["--parts", "convert"], ["--parts", "scratch,bogus"], ["--sweep-lrs", "0"], ["--ratios-from", str(tmp_path / "none.json")]):
        with pytest.raises(SystemExit) as exc:
            study.parse_args(argv)
        assert exc.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith("python -m samples.study: error:")
