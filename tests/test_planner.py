"""The pipeline memory planner (distributed/planner.py, memory_profile.py) on the tiny HF Llama of
samples/pipeline_memory.py: its hops equal what `split_stages` builds (with and without the
rank-local cache), it picks the largest aligned N that fits, refuses a budget nothing fits with
the smallest one that does, and its per-rank peak is within 15% of the peak measured on 2 gloo
processes training the rewritten model (1F1B and GPipe, Adam)."""

import pytest
import torch.distributed as dist

from attnres_compile import AttnResConfig, rewrite
from attnres_compile.distributed import SitePolicy, schedule_stage_ranks, split_stages
from attnres_compile.distributed.planner import check_layout, plan_memory
from attnres_compile.core.errors import ConfigError
from samples import pipeline_memory

GIB = 2**30


@pytest.fixture(scope="module")
def profile():
    return pipeline_memory.profile(blocks=2)


def test_profile_layers_and_sizes(profile):
    assert profile.layers == [f"model.layers.{i}" for i in range(4)]
    assert profile.links == [2, 2, 2, 2] and profile.width == 64 and profile.tokens == 2 * 64
    assert profile.stream == 128 * 64 * 4
    # embedding; four layers of q, k, v, o (64x64), gate, up, down (64x128) and two norms; the head in the last part
    layer = (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) * 4
    assert profile.params == [128 * 64 * 4, layer, layer, layer, layer + (64 + 128 * 64) * 4]
    assert all(h > 10 * profile.stream for h in profile.held[1:])  # a layer keeps many [tokens, width] values
    assert profile.outputs == 128 * 128 * 4  # the logits


def test_hops_are_what_split_stages_carries(profile):
    """4 stages, interleaved on 2 ranks, Block N=4 (B=2: every cut is a block boundary): the plan's
    bytes per hop, and with the cache the bytes sent, equal those of the real stages."""
    model, inputs = pipeline_memory.model_and_inputs()
    gm = rewrite(model, inputs, AttnResConfig(variant="block", num_blocks=4), verify_outputs=False).graph_module
    ranks = schedule_stage_ranks("Interleaved1F1B", 2, 4)
    _, real = split_stages(gm, (), inputs, num_stages=4, stage_ranks=ranks)
    plan = plan_memory(profile, 100 * GIB, 4, "interleaved", micro_batches=4, num_blocks=4)
    assert (plan.num_blocks, plan.block_size, plan.stage_ranks) == (4, 2, ranks)
    kinds = lambda hop: sorted(v.kind for v in hop.values)  # noqa: E731
    assert [kinds(h) for h in plan.hops.hops] == [kinds(h) for h in real.hops]
    assert [h.bytes for h in plan.hops.hops] == [h.bytes for h in real.hops]
    assert [h.sent_bytes for h in plan.hops.hops] == [h.sent_bytes for h in real.hops]
    assert plan.hops.hops[2].sent_bytes < plan.hops.hops[2].bytes  # rank 0 saw the early blocks at stage 0


def test_largest_aligned_n_that_fits(profile):
    full = plan_memory(profile, 100 * GIB, 2, micro_batches=4)
    assert full.variant == "full" and full.block_size == 1
    # 8 sublayers, the cut at sublayer 4: B = 1, 2, 4 align (N = 8, 4, 2); B = 3 (N = 3) does not
    assert [(c["num_blocks"], c["block_size"]) for c in full.candidates] == [(8, 1), (4, 2), (2, 4)]
    peaks = [c["peak"] for c in full.candidates]
    assert peaks == sorted(peaks, reverse=True)  # fewer blocks, less history
    assert plan_memory(profile, peaks[0] - 1, 2, micro_batches=4).num_blocks == 4
    smallest = plan_memory(profile, peaks[2], 2, micro_batches=4)
    assert smallest.num_blocks == 2 and max(r.peak for r in smallest.ranks) == peaks[2]
    with pytest.raises(ConfigError, match=rf"smallest budget that fits is {peaks[2]} B \(4\.\d MiB, Block N=2\)"):
        plan_memory(profile, peaks[2] - 1, 2, micro_batches=4)
    with pytest.raises(ConfigError, match="N=3 .* does not align with the stage cuts at sublayers 4"):
        plan_memory(profile, 100 * GIB, 2, micro_batches=4, num_blocks=3)
    assert plan_memory(profile, 100 * GIB, 2, micro_batches=4, block_size=2).num_blocks == 4


def test_in_flight_micro_batches_follow_the_schedule(profile):
    one_f_one_b = plan_memory(profile, 100 * GIB, 2, "1f1b", micro_batches=4, num_blocks=2)
    gpipe = plan_memory(profile, 100 * GIB, 2, "gpipe", micro_batches=4, num_blocks=2)
    assert [r.in_flight for r in one_f_one_b.ranks] == [[2], [1]]  # 1F1B: rank r of P holds P - r
    assert [r.in_flight for r in gpipe.ranks] == [[4], [4]]  # GPipe: every micro-batch
    # gradients exist from a stage's first backward: at 1F1B's peak (after it), not at GPipe's (before it)
    assert all(r.grads == r.params for r in one_f_one_b.ranks) and all(r.grads == 0 for r in gpipe.ranks)
    # stage 1's receive buffers hold every micro-batch's inbound hop, whatever the schedule
    assert one_f_one_b.ranks[1].buffers == gpipe.ranks[1].buffers >= 4 * one_f_one_b.hops.hops[0].bytes - \
        4 * sum(v.bytes for v in one_f_one_b.hops.hops[0].values if v.kind == "history")
    zbv = plan_memory(profile, 100 * GIB, 4, "zbv", micro_batches=4, num_blocks=4)
    assert [r.stages for r in zbv.ranks] == [[0, 3], [1, 2]]


def test_checkpointing_and_offload_terms(profile):
    """Predictions only (not measured: stage modules are flat GraphModules): checkpointed layers keep
    their inputs (and, saving the sites, their outputs) and recompute one layer in backward;
    offload moves the saved tensors to the host and keeps the stage outputs."""
    plan = lambda **kw: plan_memory(profile, 100 * GIB, 2, micro_batches=4, num_blocks=2, **kw).ranks  # noqa: E731
    plain, recompute, save = plan(), plan(checkpoint=SitePolicy(save_sites=False)), plan(checkpoint=SitePolicy())
    offload = plan(offload=True)
    for r in range(2):
        assert recompute[r].activations < save[r].activations < plain[r].activations
        assert recompute[r].transient > plain[r].transient
        assert offload[r].host > 0 and offload[r].activations + offload[r].history < plain[r].activations


@pytest.mark.parametrize("layout, message", [
    ((1, "1f1b"), "at least 2 stages"),
    ((3, "zbv"), "zbv needs stages 2 per rank"),
    ((4, "1f1b", 2), "1f1b needs stages 1 per rank"),
    ((3, "interleaved", 2), "a multiple of the ranks"),
    ((4, "pipedream"), "not one of"),
    ((4, "1f1b", None, 2), "1F1B schedule refuses 2 micro-batches"),
])
def test_bad_layouts_are_one_line(layout, message):
    with pytest.raises(ConfigError, match=message):
        check_layout(*layout)


needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")


@needs_gloo
def test_prediction_within_15_percent_of_the_measured_peak(profile):
    rows = pipeline_memory.compare([("1f1b", 2, 4), ("gpipe", 2, 4)], profiles={2: profile})
    for row in rows:
        assert abs(row["error"]) <= 0.15, row
    measured = {(r["schedule"], r["rank"]): r["measured"] for r in rows}
    assert measured["gpipe", 0] > 1.3 * measured["1f1b", 0]  # GPipe holds 4 micro-batches, 1F1B 2


# ---------------------------------------------------------------------------------------------
# issue 62 item 4: every layout number bounded before any schedule is built; SIGTERM ends it


@pytest.mark.parametrize("layout, message", [
    ((4, "1f1b", None, 100_000_000), "micro_batches=100000000: at most 256"),
    ((20_000_000, "interleaved", 1), "stages=20000000: at most 256"),
    ((10**23, "1f1b"), "stages=100000000000000000000000: at most 256"),
    ((4, "gpipe", 4, 10**40), "micro_batches=10000000000000000000000000000000000000000: at most 256"),
    ((128, "1f1b", 128, 128), "stages x micro-batches = 16384: at most 8192"),
    ((2.0, "1f1b"), "stages=2.0 is not a whole number"),
    ((4, "1f1b", True), "ranks=True is not a whole number"),
    ((4, "1f1b", 0), "ranks=0: at least 1"),
    ((4, "1f1b", 10**30), "ranks=1000000000000000000000000000000: at most 256"),
])
def test_layout_numbers_are_bounded_before_any_schedule(layout, message, monkeypatch):
    from attnres_compile.distributed import planner

    monkeypatch.setattr(planner, "_pipeline_order", lambda *a: pytest.fail("a schedule was built"))
    with pytest.raises(ConfigError, match=message):
        check_layout(*layout)


def test_stages_beyond_the_models_blocks_are_refused_before_any_schedule(profile, monkeypatch):
    from attnres_compile.distributed import planner

    monkeypatch.setattr(planner, "_pipeline_order", lambda *a: pytest.fail("a schedule was built"))
    with pytest.raises(ConfigError, match="8 stages, but the model has 4 layers"):
        plan_memory(profile, GIB, 8, "interleaved", ranks=4, micro_batches=8)


def test_the_largest_layouts_plan_in_seconds(profile):
    import time

    start = time.process_time()
    with pytest.raises(ConfigError, match="the smallest budget that fits"):
        plan_memory(profile, 1, 4, "zbv", micro_batches=256)
    assert time.process_time() - start < 30


@pytest.mark.parametrize("argv", [
    ["--micro-batches", "100000000"],
    ["--stages", "20000000", "--ranks", "1", "--schedule", "interleaved"],
    ["--stages", "64", "--micro-batches", "256"],
])
def test_inspect_budget_refuses_huge_layouts_at_once(argv):
    """`inspect --budget 1GiB --micro-batches 100000000` built torch's whole order first: 21 GB resident
    in minutes. Now one line, exit 2, in about the time the CLI takes to start."""
    from forked_cli import run_cli

    run = run_cli(["inspect", "tests.missing_module:factory", "--budget", "1GiB", *argv], timeout=60)
    assert run.code == 2 and len(run.lines) == 1 and "at most" in run.lines[0], (run.code, run.stderr)
    assert run.seconds < 20, run.seconds


def test_sigterm_ends_inspect_budget_at_any_point(tmp_path):
    """SIGTERM at any moment of `inspect --budget` (the factory's import, tracing, profiling, the
    schedule's order, the plan) ends it within seconds: exit 143 and one line, or the plan if it won."""
    import signal
    from pathlib import Path

    from forked_cli import run_cli

    root = Path(__file__).resolve().parents[1]
    argv = ["inspect", "samples.pipeline_memory:model_and_inputs", "--budget", "1", "--stages", "4", "--schedule",
            "zbv", "--micro-batches", "256"]
    for delay in (0.05, 0.5, 2.0, 5.0, 10.0):  # the whole run takes about 20 s on a loaded 2-core machine
        run = run_cli(argv, cwd=root, timeout=delay + 20, send=(signal.SIGTERM, delay))
        assert not run.timed_out and run.code in (143, 2), (delay, run.code, run.signal, run.stderr)
        assert len(run.lines) == 1, run.stderr
        if run.code == 143:
            assert "terminated (SIGTERM)" in run.lines[0]


def test_plan_memory_and_plan_traced_refuse_what_they_cannot_plan(profile):
    """Issue 62 item 8: plan_memory(None, ...) and plan_traced(None, ...) ended in NoneType errors."""
    from attnres_compile.distributed.planner import plan_traced

    with pytest.raises(ConfigError, match="plan_memory: profile is NoneType"):
        plan_memory(None, GIB, 2)
    with pytest.raises(ConfigError, match="budget=nan is not a whole number"):
        plan_memory(profile, float("nan"), 2)
    with pytest.raises(ConfigError, match="plan_traced: traced is NoneType"):
        plan_traced(None, {"chains": []}, GIB, 2)
    with pytest.raises(ConfigError, match="plan_traced: report is NoneType"):
        plan_traced(type("T", (), {"graph_module": object()})(), None, GIB, 2)
