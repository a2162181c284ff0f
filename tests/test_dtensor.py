"""The depth-attention ops take DTensor inputs (attnres_compile/distributed/dtensor.py): 2 gloo CPU
processes distribute the same seeded sources and query, run the ops forward and backward, and the
gathered results (`full_tensor()`) match the single-process op; sharding the feature axis is
refused in one line. A rewritten tiny GPT runs on sequence-sharded token ids, every site on
sequence-sharded sources, with the logits and pseudo-query gradients of one process, and a
`DepthMonitor` watching it (each rank its rows, reduced over both) sees one process's depth weights.

One spawn runs every case (a child's start, torch and the package imported, costs seconds) and
rank 0 hands back, per case, the placements it saw and the largest difference from the
reference relative to the reference's largest magnitude. The eager reference computes the local
rows in the children and the reference alike (the fused TVM kernels would be built per child).
"""

import contextlib
import copy
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import fx
from torch.nn import functional as F

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")

WORLD = 2
SHAPE = (2, 6, 8)  # [batch, sequence, features]
EPS, SCALE = 1e-6, 1.5


def _inputs(shape=SHAPE, dim=-1, n=3):
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(shape, generator=g) for _ in range(n)]
    query = torch.randn(shape[dim], generator=g)
    grad = torch.randn(shape, generator=g)
    return sources, query, grad


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach() - want.detach()).abs().max() / want.detach().abs().max())


def _names(t) -> list[str]:
    return [str(p) for p in t.placements]


def _forward_backward(mesh, source_placements, dim=-1, shape=SHAPE) -> dict:
    """The op and its gradients on DTensors placed as `source_placements` (one per source, a list
    on a 2-D mesh), against one process."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    sources, query, grad = _inputs(shape, dim, len(source_placements))
    ref_sources = [s.clone().requires_grad_() for s in sources]
    ref_query = query.clone().requires_grad_()
    ref = torch.ops.attnres.depth_attention(ref_sources, ref_query, EPS, SCALE, dim)
    ref_grads = torch.autograd.grad(ref, [*ref_sources, ref_query], grad)

    d_sources = [distribute_tensor(s, mesh, p if isinstance(p, list) else [p]).requires_grad_()
                 for s, p in zip(sources, source_placements)]
    d_query = distribute_tensor(query, mesh, [Replicate()] * mesh.ndim).requires_grad_()
    out = torch.ops.attnres.depth_attention(d_sources, d_query, EPS, SCALE, dim)
    d_grad = distribute_tensor(grad, mesh, out.placements)
    grads = torch.autograd.grad(out, [*d_sources, d_query], d_grad)
    return {"out": _names(out), "source_grads": [_names(g) for g in grads[:-1]], "query_grad": _names(grads[-1]),
            "out_diff": _rel(out.full_tensor(), ref),
            "source_grad_diff": max(_rel(g.full_tensor(), r) for g, r in zip(grads[:-1], ref_grads[:-1])),
            "query_grad_diff": _rel(grads[-1].full_tensor(), ref_grads[-1])}


def _backward_feature_sharded_grad(mesh) -> dict:
    """The backward op on sequence-sharded sources with an output gradient sharded on the feature axis."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    sources, query, grad = _inputs()
    ref_grads, ref_query_grad = torch.ops.attnres.depth_attention_backward(sources, query, grad, EPS, SCALE, -1)
    grads, query_grad = torch.ops.attnres.depth_attention_backward(
        [distribute_tensor(s, mesh, [Shard(1)]) for s in sources], distribute_tensor(query, mesh, [Replicate()]),
        distribute_tensor(grad, mesh, [Shard(2)]), EPS, SCALE, -1)
    return {"source_grads": [_names(g) for g in grads], "query_grad": _names(query_grad),
            "source_grad_diff": max(_rel(g.full_tensor(), r) for g, r in zip(grads, ref_grads)),
            "query_grad_diff": _rel(query_grad.full_tensor(), ref_query_grad)}


def _refusal(mesh, source_placement, query_placement) -> str:
    """The error of the op on sources placed as `source_placement` and the query as `query_placement`."""
    from torch.distributed.tensor import distribute_tensor

    from attnres_compile.core.errors import ShardingError

    sources, query, _ = _inputs()
    d_sources = [distribute_tensor(s, mesh, [source_placement]) for s in sources]
    d_query = distribute_tensor(query, mesh, [query_placement])
    try:
        torch.ops.attnres.depth_attention(d_sources, d_query, EPS, SCALE, -1)
    except ShardingError as e:
        return str(e)
    return "no error"


def _two_phase(mesh) -> dict:
    """The partial/merge pair on sequence-sharded sources against one process."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    history, query, _ = _inputs(n=4)
    extra = history[2:]
    history = history[:2]
    queries = torch.stack([query, query.flip(0)])
    m, l, acc = torch.ops.attnres.depth_attention_partial(history, queries, EPS, -1)
    ref = torch.ops.attnres.depth_attention_merge(m, l, acc, 1, extra, queries[1], EPS, SCALE, -1)

    def shard(ts):
        return [distribute_tensor(t, mesh, [Shard(1)]) for t in ts]

    d_queries = distribute_tensor(queries, mesh, [Replicate()])
    state = torch.ops.attnres.depth_attention_partial(shard(history), d_queries, EPS, -1)
    out = torch.ops.attnres.depth_attention_merge(*state, 1, shard(extra), d_queries[1], EPS, SCALE, -1)
    return {"state": [_names(t) for t in state], "out": _names(out),
            "state_diff": max(_rel(t.full_tensor(), r) for t, r in zip(state, (m, l, acc))),
            "out_diff": _rel(out.full_tensor(), ref)}


class _Gathered(fx.Interpreter):
    """Runs a GraphModule on DTensors, recording the placements at each depth-attention site.
    torch 2.13's DTensor has no rule for CPU attention (aten._scaled_dot_product_flash_attention_for_cpu),
    so attention runs on gathered inputs and its output is placed back as its query was, as
    sequence (context) parallelism would; torch.export's metadata assertions check the local
    tensors. Every other op, the sites' included, runs through DTensor."""

    def __init__(self, gm, mesh):
        super().__init__(gm)
        self.mesh, self.sites = mesh, []

    def call_function(self, target, args, kwargs):
        from torch.distributed.tensor import DTensor, Replicate

        if target is torch.ops.aten.scaled_dot_product_attention.default:
            placements = args[0].placements
            q, k, v = (a.redistribute(self.mesh, [Replicate()]).to_local() for a in args[:3])
            y = target(q, k, v, *args[3:], **kwargs)
            return DTensor.from_local(y, self.mesh, [Replicate()]).redistribute(self.mesh, placements)
        if target is torch.ops.aten._assert_tensor_metadata.default:
            return target(*[a.to_local() if isinstance(a, DTensor) else a for a in args], **kwargs)
        if target is torch.ops.attnres.depth_attention.default:
            self.sites.append([_names(t) for t in (*args[0], args[1])])
        return super().call_function(target, args, kwargs)


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _train_step(gm, mesh, partition, inputs, dinputs, target, dtarget, watch: bool = False) -> dict:
    """One loss and backward of `gm` on `inputs` in one process and, its parameters placed by
    `partition` (distribute_module's partition_fn), on `dinputs`: the logits and the pseudo-queries'
    gradients, gathered, against the process's; `watch`: both watched by a DepthMonitor (rows
    split over the ranks: data or sequence parallel, not tensor parallel)."""
    from torch.distributed.tensor import distribute_module
    from torch.distributed.tensor.experimental import implicit_replication

    from attnres_compile.monitor import DepthMonitor

    ref = copy.deepcopy(gm)
    if watch:  # the reference watched alone: a group of this process only (new_group is called by every rank)
        alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    ref_monitor = DepthMonitor(ref, group=alone) if watch else None
    with ref_monitor.watch(0) if watch else contextlib.nullcontext():
        ref_logits = _logits(ref(*inputs))
    F.cross_entropy(ref_logits.flatten(0, 1), target.flatten()).backward()
    module = distribute_module(gm, mesh, partition)
    run = _Gathered(module, mesh)
    monitor = DepthMonitor(module) if watch else None
    with implicit_replication():  # the graph's own plain tensors (positions from arange, masks) as replicated
        with monitor.watch(0) if watch else contextlib.nullcontext():
            logits = _logits(run.run(*dinputs))
        F.cross_entropy(logits.flatten(0, 1), dtarget.flatten()).backward()
    queries = {n: p.grad for n, p in gm.named_parameters() if n.startswith("attnres.")}
    want = dict(ref.named_parameters())
    out = {"sites": run.sites, "logits": _names(logits), "logits_diff": _rel(logits.full_tensor(), ref_logits),
           "query_grads": sorted({str(_names(q)) for q in queries.values()}), "queries": len(queries),
           "query_grad_diff": max(_rel(q.full_tensor(), want[n].grad) for n, q in queries.items())}
    if watch:
        out["depth"], out["depth_ref"] = monitor.stats(), ref_monitor.stats()
    return out


def _gpt(mesh) -> dict:
    """A rewritten tiny GPT, parameters replicated, on sequence-sharded token ids."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from attnres_compile import AttnResConfig, rewrite
    from samples.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab=64, dim=32, layers=2, heads=2, max_len=16).eval()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
    gm = rewrite(model, (x,), AttnResConfig()).graph_module
    shard = [Shard(1)]
    return _train_step(gm, mesh, None, (x,), (distribute_tensor(x, mesh, shard),), y, distribute_tensor(y, mesh, shard),
                       watch=True)


_COLUMNS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # Megatron-style tensor parallelism
_ROWS = ("o_proj", "down_proj")


def _tensor_parallel(name, module, mesh):
    """Column-wise q/k/v/gate/up (weights Shard(0)), row-wise o/down (Shard(1)), the rest replicated."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    for key, p in list(module.named_parameters(recurse=False)):
        path = f"{name}.{key}"
        placement = Shard(0) if any(c in path for c in _COLUMNS) else Shard(1) if any(r in path for r in _ROWS) else Replicate()
        module.register_parameter(key, torch.nn.Parameter(distribute_tensor(p.data, mesh, [placement])))


def _llama_tp(mesh) -> dict:
    """A rewritten tiny HF Llama, tensor-parallel: its sites read the row-wise layers' Partial sums."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    from attnres_compile import rewrite
    from samples import hf_models

    model, inputs = hf_models.llama_factory()
    gm = rewrite(model, inputs).graph_module
    x, mask = inputs["input_ids"], inputs["attention_mask"]
    y = x.roll(-1, 1)
    replicate = [Replicate()]
    return _train_step(gm, mesh, _tensor_parallel, (x, mask, False), (distribute_tensor(x, mesh, replicate), mask, False),
                       y, distribute_tensor(y, mesh, replicate))


def _cases(mesh) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    return {
        "sequence": _forward_backward(mesh, [Shard(1)] * 3),
        "batch": _forward_backward(mesh, [Shard(0)] * 3),
        "replicate": _forward_backward(mesh, [Replicate()] * 3),
        "mixed": _forward_backward(mesh, [Shard(1), Replicate(), Shard(0)]),
        "feature_axis_middle": _forward_backward(mesh, [Shard(2)] * 2, dim=1, shape=(2, 8, 6)),
        "mesh_2d": _forward_backward(init_device_mesh("cpu", (1, WORLD)), [[Shard(0), Shard(1)]] * 3),
        "feature_sharded_grad": _backward_feature_sharded_grad(mesh),
        "two_phase": _two_phase(mesh),
        "gpt": _gpt(mesh),
        "llama_tp": _llama_tp(mesh),
        "refuse_feature": _refusal(mesh, Shard(2), Replicate()),
        "refuse_query": _refusal(mesh, Shard(1), Shard(0)),
    }


def _worker(rank: int, rendezvous: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import attnres_compile.distributed  # noqa: F401  (registers the DTensor rules)
    from attnres_compile.ops import depth_attention as op

    torch.set_num_threads(1)
    op.set_kernel("eager")
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    try:
        results = _cases(init_device_mesh("cpu", (WORLD,)))
        if rank == 0:
            Path(out).write_text(json.dumps(results))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(os.path.join(tmp, "rendezvous"), out), nprocs=WORLD)
        return json.loads(Path(out).read_text())


TOLERANCE = 1e-6


@pytest.mark.parametrize("case, placement, query_grad", [
    ("sequence", "S(1)", "P(sum)"), ("batch", "S(0)", "P(sum)"), ("replicate", "R", "R"),
    ("feature_axis_middle", "S(2)", "P(sum)")])
def test_placements_follow_the_sources_and_values_match_one_process(results, case, placement, query_grad):
    r = results[case]
    assert r["out"] == [placement]
    assert r["source_grads"] == [[placement]] * len(r["source_grads"])
    assert r["query_grad"] == [query_grad]
    for key in ("out_diff", "source_grad_diff", "query_grad_diff"):
        assert r[key] <= TOLERANCE, (case, key, r[key])


def test_2d_mesh_batch_and_sequence_shards(results):
    r = results["mesh_2d"]  # mesh (1, 2): batch over its first axis, sequence over its second
    assert r["out"] == ["S(0)", "S(1)"] and r["source_grads"] == [["S(0)", "S(1)"]] * 3
    assert r["query_grad"] == ["P(sum)", "P(sum)"]
    for key in ("out_diff", "source_grad_diff", "query_grad_diff"):
        assert r[key] <= TOLERANCE, key


def test_mixed_placements_are_redistributed_to_one_shard(results):
    r = results["mixed"]  # sources S(1), R, S(0): DTensor's costs choose the shard, the backward follows it
    assert r["out"] in (["S(0)"], ["S(1)"])
    assert r["source_grads"] == [r["out"]] * 3
    assert r["query_grad"] == ["P(sum)"]
    for key in ("out_diff", "source_grad_diff", "query_grad_diff"):
        assert r[key] <= TOLERANCE, key


def test_backward_redistributes_a_feature_sharded_gradient_to_the_sources_rows(results):
    r = results["feature_sharded_grad"]
    assert r["source_grads"] == [["S(1)"]] * 3 and r["query_grad"] == ["P(sum)"]
    assert r["source_grad_diff"] <= TOLERANCE and r["query_grad_diff"] <= TOLERANCE, r


def test_two_phase_pair_shards_its_state_with_the_rows(results):
    r = results["two_phase"]
    assert r["state"] == [["S(2)"]] * 3  # [B, batch, sequence(, features)]: the sequence is state axis 2
    assert r["out"] == ["S(1)"]
    assert r["state_diff"] <= TOLERANCE and r["out_diff"] <= TOLERANCE


@pytest.mark.parametrize("case, what", [("refuse_feature", "sources sharded on their feature axis 2 (placements S(2))"),
                                        ("refuse_query", "a sharded query")])
def test_sharding_the_feature_axis_is_refused_in_one_line(results, case, what):
    message = results[case]
    assert what in message and "shard the sources on the sequence" in message and "\n" not in message


def test_rewritten_gpt_runs_sequence_sharded(results):
    r = results["gpt"]
    assert len(r["sites"]) == r["queries"] >= 4
    assert all(site == [["S(1)"]] * (len(site) - 1) + [["R"]] for site in r["sites"])  # sources S(1), query R
    assert r["logits"] == ["S(1)"] and r["query_grads"] == [str(["P(sum)"])]
    assert r["logits_diff"] <= TOLERANCE and r["query_grad_diff"] <= TOLERANCE, r
    # the monitor found the replicated queries' local tensors and summed both ranks' rows
    got, want = r["depth"]["sites"], r["depth_ref"]["sites"]
    assert [(s["site"], s["rows"], s["sources"]) for s in got] == [(s["site"], s["rows"], s["sources"]) for s in want]
    assert len(got) == r["queries"] and got[0]["rows"] == 32
    for a, b in zip(got, want):
        assert a["weights"] == pytest.approx(b["weights"], abs=1e-6) and a["entropy"] == pytest.approx(b["entropy"], abs=1e-6)
        assert a["rms"] == pytest.approx(b["rms"], rel=1e-5)


def test_rewritten_llama_runs_tensor_parallel(results):
    r = results["llama_tp"]
    assert len(r["sites"]) == r["queries"] >= 4
    assert all(["P(sum)"] in site for site in r["sites"][1:])  # the attention and MLP outputs, summed later
    assert r["query_grads"] == [str(["P(sum)"])]
    assert r["logits_diff"] <= TOLERANCE and r["query_grad_diff"] <= TOLERANCE, r
