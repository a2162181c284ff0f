"""The rewritten model trains under DDP and FSDP2 (gloo, 2 CPU processes) as it does in one process:
the flat GraphModule (DDP, FSDP2 on the root) and its called blocks (FSDP2 per block, with CPU
offload, with checkpointed blocks recomputing their sites).

It is traced at the global batch and each rank runs half of it: the rewritten module takes any
batch size (a module guarded on the traced batch fails with `Guard failed: ids.size()[0] == 8`).
Every other step is watched by a `DepthMonitor`, whose stats, reduced over the two processes,
are those of one process watching the whole global batch (FSDP2's unsharded queries found by
name, checkpointed sites counted once).
"""

import pytest
import torch.distributed as dist

from samples import train_distributed

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")


def _check(modes, variant):
    ref = train_distributed.reference(variant, steps=4, world=2)
    results = train_distributed.run(modes, world=2, variant=variant, steps=4)
    for mode in modes:
        assert results[mode]["losses"] == pytest.approx(ref["losses"], abs=1e-5), mode
        assert results[mode]["queries"].keys() == ref["queries"].keys()
        for name, q in ref["queries"].items():
            assert results[mode]["queries"][name] == pytest.approx(q, abs=1e-5), (mode, name)
    assert any(abs(v) > 1e-3 for q in ref["queries"].values() for v in q)  # the pseudo-queries trained
    assert [h["step"] for h in ref["depth"]] == [0, 2]
    for mode in modes:
        _same_depth_stats(results[mode]["depth"], ref["depth"], mode)
    return results


def _same_depth_stats(got, ref, mode):
    assert [h["step"] for h in got] == [h["step"] for h in ref], mode
    for g, r in zip(got, ref):
        assert [(s["chain"], s["site"], s["rows"], s["sources"]) for s in g["sites"]] == \
            [(s["chain"], s["site"], s["rows"], s["sources"]) for s in r["sites"]], mode
        for a, b in zip(g["sites"], r["sites"]):
            for key in ("weights", "weights_max"):
                assert a[key] == pytest.approx(b[key], abs=1e-6), (mode, g["step"], a["site"], key)
            assert a["entropy"] == pytest.approx(b["entropy"], abs=1e-6), (mode, g["step"], a["site"])
            assert a["rms"] == pytest.approx(b["rms"], rel=1e-5), (mode, g["step"], a["site"])
    # by step 2 the weights moved off uniform: the stats compared are not all the same number
    assert any(abs(w - 1 / s["sources"]) > 1e-4 for s in ref[-1]["sites"] for w in s["weights"])


def test_ddp_and_fsdp2_match_single_process():
    _check(("ddp", "fsdp"), "full")


def test_per_block_fsdp2_offload_and_checkpointing_match_single_process():
    results = _check(("fsdp_blocks", "fsdp_offload", "fsdp_checkpoint"), "block")
    layers = train_distributed.SIZE["layers"]
    for mode in ("fsdp_blocks", "fsdp_offload", "fsdp_checkpoint"):
        assert results[mode]["blocks"] == [f"blocks.{i}" for i in range(layers)], mode
        assert results[mode]["sharded"], mode
    # every site of every step was recomputed in backward (checkpointed blocks, sites not saved)
    assert results["fsdp_checkpoint"]["recomputed"] == results["fsdp_checkpoint"]["site_calls"] > 0
