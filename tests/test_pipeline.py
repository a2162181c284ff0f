"""Pipeline stages (distributed/pipeline.py): one process first (the stages chained are the model, the
plan counts what crosses each hop), then torch.distributed.pipelining's schedules on gloo.

Each schedule trains the stages on 2 processes and must give the one-process per-micro-batch
losses and pseudo-query gradients (samples/train_pipeline.py); the forward bytes each stage posts
to its sends must equal the plan's bytes for that hop. With the rank-local cache (stage_ranks) the
same, and a hop sends only what its receiving rank does not hold.
"""

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from attnres_compile import AttnResConfig, rewrite
from attnres_compile.distributed import schedule_stage_ranks, split_stages, stage_cache
from attnres_compile.core.errors import ConfigError
from samples import train_pipeline
from samples.hf_models import gpt2_factory, llama_factory
from samples.models import GPT


def _gpt(variant, layers=4, blocks=2):
    torch.manual_seed(0)
    model = GPT(vocab=64, dim=32, layers=layers, heads=2, max_len=16).eval()
    x = torch.randint(0, 64, (4, 16))
    config = AttnResConfig(variant=variant, num_blocks=blocks if variant == "block" else None)
    return rewrite(model, (x,), config).graph_module, x


def _chain(stages, *inputs):
    out = inputs
    for stage in stages:
        out = stage(*out)
        out = out if isinstance(out, tuple) else (out,)
    return out[0]


@pytest.mark.parametrize("variant", ["block", "full"])
def test_stages_chained_are_the_model(variant):
    gm, x = _gpt(variant)
    mb = x[:2]
    stages, plan = split_stages(gm, (mb,), num_stages=4)
    assert plan.stages == [[f"blocks.{i}"] for i in range(4)]
    assert torch.equal(_chain(stages, mb), gm(mb))
    names = [set(dict(s.named_parameters())) for s in stages]
    assert set().union(*names) == set(dict(gm.named_parameters()))
    assert sum(map(len, names)) == len(dict(gm.named_parameters()))  # each parameter in one stage
    # gradients flow back through the relays to the stage that made each value
    F.cross_entropy(_chain(stages, mb).flatten(0, 1), mb.flatten()).backward()
    gm.zero_grad()
    F.cross_entropy(gm(mb).flatten(0, 1), mb.flatten()).backward()
    grads = {n: p.grad for s in stages for n, p in s.named_parameters()}
    for n, p in gm.named_parameters():
        assert torch.allclose(grads[n], p.grad, rtol=1e-5, atol=1e-6 * p.grad.abs().max().item()), n


def test_cached_stages_chained_are_the_model(monkeypatch):
    """The rank-local cache in one process (a cache per rank value): a 6-layer GPT Block(3) in 6
    stages on 2 ranks, loop placement (Interleaved1F1B: 3 stages a rank, so a value has 2 readers)
    and V (ZBV with 3 stages a rank). The chain is the model, forward and backward; a hop into a
    rank that held an earlier stage leaves out what that stage had (the embedding `add`, block sums),
    and the gradient the readers send back through the writer's mailbox matters: dropped, the
    gradients differ."""
    gm, x = _gpt("block", layers=6, blocks=3)
    mb = x[:2]
    gm.zero_grad()
    F.cross_entropy(gm(mb).flatten(0, 1), mb.flatten()).backward()
    want = {n: p.grad.clone() for n, p in gm.named_parameters()}

    def grads(stages):
        for stage in stages:
            stage.zero_grad(set_to_none=True)
        out = _chain(stages, mb)
        F.cross_entropy(out.flatten(0, 1), mb.flatten()).backward()
        got = {n: p.grad for stage in stages for n, p in stage.named_parameters()}
        close = all(torch.allclose(got[n], w, rtol=1e-5, atol=1e-6 * w.abs().max().item()) for n, w in want.items())
        return out, close, max(((got[n] - w).abs().max() / w.abs().max()).item() for n, w in want.items())

    placements = {"Interleaved1F1B": ([0, 1, 0, 1, 0, 1], [[], ["add"], ["add", "add_3"], ["add", "add_3"],
                                                            ["add", "add_3", "add_6"]]),
                  "ZBVZeroBubble": ([0, 1, 1, 0, 0, 1], [[], [], ["add"], [], ["add", "add_3"]])}
    for schedule, (ranks, cached) in placements.items():
        assert schedule_stage_ranks(schedule, 2, 6) == ranks  # torch's own placement
        stages, plan = split_stages(gm, (mb,), num_stages=6, stage_ranks=ranks)
        assert [[v.name for v in h.values if v.cached] for h in plan.hops] == cached
        assert [h.sent_bytes < h.bytes for h in plan.hops] == [bool(c) for c in cached]
        assert stages[0].stage_cache is stages[3 if ranks[3] == 0 else 2].stage_cache is not stages[1].stage_cache
        out, close, worst = grads(stages)
        assert torch.equal(out, gm(mb)) and close, (schedule, worst)
        assert all(len(stage.stage_cache) == 0 for stage in stages)  # every entry read
        with monkeypatch.context() as m:  # the readers' gradients go nowhere
            m.setattr(stage_cache._Mailbox, "deposit", lambda box, grad: setattr(box, "count", box.count + 1))
            assert grads(stages)[2] > 1e-2, schedule
    with pytest.raises(ConfigError, match="stage_ranks has 2 entries for 6 stages"):
        split_stages(gm, (mb,), num_stages=6, stage_ranks=[0, 1])


def test_plan_counts_what_each_hop_carries():
    block, x = _gpt("block")
    full, _ = _gpt("full")
    mb = x[:2]
    _, bplan = split_stages(block, (mb,), num_stages=4)
    _, fplan = split_stages(full, (mb,), num_stages=4)
    width = 2 * 16 * 32 * 4  # one [2, 16, 32] float32 tensor
    for plan in (bplan, fplan):
        for hop in plan.hops:
            assert hop.bytes == sum(v.bytes for v in hop.values) == width * len(hop.values)
            assert sum(v.kind == "stream" for v in hop.values) == 1
        assert plan.tokens == 32 and plan.bytes_per_token(0) == plan.hops[0].bytes / 32
    history = lambda plan: [sum(v.kind == "history" for v in h.values) for h in plan.hops]  # noqa: E731
    assert history(fplan) == [3, 5, 7]  # Full: the embedding and every sublayer output so far
    assert max(history(bplan)) <= 3  # Block(2): the block sums and the current partial sum
    assert any(v.relayed for h in bplan.hops for v in h.values)
    assert "hop" in bplan.table() and len(bplan.table().splitlines()) == 4


def test_explicit_cuts_and_hf_llama_layers():
    model, inputs = llama_factory(layers=4)
    gm = rewrite(model, inputs, AttnResConfig(variant="block", num_blocks=2)).graph_module
    stages, plan = split_stages(gm, (), inputs, cuts=["model.layers.1", "model.layers.3"])
    assert plan.stages == [["model.layers.0"], ["model.layers.1", "model.layers.2"], ["model.layers.3"]]
    assert plan.inputs[:2] == ["input_ids", "attention_mask"]
    assert any(v.kind == "other" for v in plan.hops[0].values)  # the mask and rotary tables are carried too
    want = gm(**inputs)
    want = want.logits if hasattr(want, "logits") else want[0]
    assert torch.equal(_chain(stages, inputs["input_ids"], inputs["attention_mask"]), want)


def test_refusals_name_the_problem():
    gm, x = _gpt("full")
    with pytest.raises(ConfigError, match=r"carry 5 history tensors .* variant='block'"):
        split_stages(gm, (x,), num_stages=4, max_carried=4)
    with pytest.raises(ConfigError, match="not a block"):
        split_stages(gm, (x,), cuts=["blocks.9"])
    with pytest.raises(ConfigError, match="use 2 to 4 stages"):
        split_stages(gm, (x,), num_stages=5)
    with pytest.raises(ConfigError, match="not both"):
        split_stages(gm, (x,))
    model, inputs = gpt2_factory(layers=2)  # GPT-2 ties its head to the token embedding
    tied = rewrite(model, inputs, AttnResConfig(variant="full")).graph_module
    with pytest.raises(ConfigError, match="tied weights"):
        split_stages(tied, (), inputs, num_stages=2)


needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")


@needs_gloo
@pytest.mark.parametrize("schedules, cache", [(("gpipe", "1f1b"), False), (("interleaved", "zbv"), False),
                                              (("interleaved", "zbv"), True)])
def test_schedules_train_as_one_process(schedules, cache):
    """With `cache` (the rank-local cache, 2 ranks × 2 stages): the same losses and query gradients
    (each to 1e-6 of its largest value), and each stage sends what the plan's cached hop carries,
    less than without the cache; no entry is left in a rank's cache after the steps."""
    ref = train_pipeline.reference("block", steps=2)
    results = train_pipeline.run(schedules, world=2, variant="block", steps=2, cache=cache)
    for name, r in results.items():
        for got, want in zip(r["losses"], ref["losses"]):
            assert got == pytest.approx(want, abs=1e-6), name
        for got, want in zip(r["grads"], ref["grads"]):
            assert got.keys() == want.keys()
            for k in want:
                assert got[k] == pytest.approx(want[k], abs=1e-6 * max(map(abs, want[k]))), (name, k)
        hops = {h["index"]: h["sent_bytes"] for h in r["plan"]["hops"]}
        for stage, sent in r["sent"].items():
            # a hop to a stage on the same rank (ZBV's middle) is handed over locally, with no send
            assert sent in ((hops.get(stage, 0),) if name != "zbv" or stage != 1 else (0,)), (name, stage)
        full = sum(h["bytes"] for h in r["plan"]["hops"])
        assert (sum(hops.values()) < full) == cache and r["held"] == 0, name
    assert any(abs(v) > 1e-4 for g in ref["grads"] for q in g.values() for v in q)  # the queries learn


@needs_gloo
@pytest.mark.slow
def test_pipeline_times_fsdp2_trains_as_one_process():
    """2 stages × 2 FSDP2 ranks (4 processes, a (pp, dp) mesh): each data-parallel half of the batch
    runs its own 1F1B pipeline; losses and gathered query gradients equal one process's."""
    ref = train_pipeline.reference("block", steps=2, dp=2)
    r = train_pipeline.run(("1f1b",), world=4, variant="block", steps=2, dp=2)["1f1b"]
    for got, want in zip(r["losses"], ref["losses"]):
        assert got == pytest.approx(want, abs=1e-6)
    for got, want in zip(r["grads"], ref["grads"]):
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(want[k], abs=1e-6), k


@needs_gloo
def test_torch_traced_frontend_fails_without_the_relays():
    """Why split_stages relays: torch's own traced frontend, cut at the same blocks, feeds stage 0's
    block sum straight to stages 2 and 3 (skip connections), and its 1F1B backward refuses them."""
    pipe, _ = train_pipeline.traced_frontend()
    graph = pipe.split_gm.graph
    stage = {n: int(n.target.rsplit("_", 1)[1]) for n in graph.nodes if n.op == "call_module"}  # submod_pp_<i>
    made_by = {n: stage[n.args[0]] for n in graph.nodes if n.op == "call_function" and n.args and n.args[0] in stage}
    skips = {(made_by[a], stage[n]) for n in stage for a in n.all_input_nodes
             if a in made_by and stage[n] > made_by[a] + 1}
    assert (0, 2) in skips and (0, 3) in skips
    errors = train_pipeline.traced_frontend_errors(world=4)
    assert any(e and "Backward of skip connections not supported yet" in e for e in errors), errors
