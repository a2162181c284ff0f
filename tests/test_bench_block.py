"""`bench block`: the schedule and history counts exactly on small cases, then a quick run end to end."""

from __future__ import annotations

import argparse
import io

import pytest
import torch

from attnres_compile import AttnResConfig, rewrite
from attnres_compile.bench import block


def test_site_terms_phases_and_bytes():
    """L=6, N=2: B=3; sites 1-3 read [v_0, P], sites 4-6 read [v_0, b_1, P]."""
    terms, size = block.site_terms(6, 2)
    assert size == 3
    assert terms[0] == [(0,), (1,)] and terms[4] == [(0,), (1, 2, 3), (4, 5)]
    assert block.phases(terms) == [([(0,)], [0, 1, 2]), ([(0,), (1, 2, 3)], [3, 4, 5])]
    T, D = 16, 8
    t, w, state = T * D * 4, D * 4, (T * D + 2 * T) * 4
    # one-pass: (|S_k| + 1) tensors per site, |S_k| = 2, 2, 2, 3, 3, 3
    assert block.onepass_bytes(terms, T, D) == 21 * t + 6 * w
    # two-phase: phase 1 reads 1 then 2 sources and writes 6 states; 6 merges read a state, a
    # partial sum and a query and write an output
    assert block.phase1_bytes(terms, T, D) == 3 * t + 6 * w + 6 * state
    assert block.twophase_bytes(terms, T, D) == 3 * t + 6 * w + 6 * state + 6 * (state + 2 * t + w)


@pytest.mark.parametrize("sublayers, blocks, full, blocked", [(10, 8, 11, 8), (8, 8, 9, 9)])
def test_history_walk_of_real_rewrites(sublayers, blocks, full, blocked):
    """Full keeps v_0..v_L alive to the last site: L+1 tensors. Block (B = ceil(L/N) = 2 for
    L=10: five blocks) peaks while the last partial sum is formed: v_0, four completed blocks,
    P_(L-1), v_L and P_L = 8. With B = 1 (L <= N) Block is Full."""
    model = block.MLPStack(sublayers, 16).eval()
    ids = torch.randint(0, block.VOCAB, (8,))
    counts = {}
    for variant in ("full", "block"):
        config = AttnResConfig(variant=variant, num_blocks=blocks if variant == "block" else None)
        counts[variant] = block.history_walk(rewrite(model, (ids,), config, verify_outputs=False).graph_module.graph)
    assert counts["full"] == {"tensors": full, "site_terms": sublayers + 1}
    assert counts["block"]["tensors"] == blocked


@pytest.fixture(scope="module")
def quick():
    args = argparse.Namespace(quick=True, device="cpu", threads=2, rounds=1)
    return block.run(args, io.StringIO())


def test_quick_schedules(quick):
    cfg = quick["config"]["schedules"]
    terms, _ = block.site_terms(cfg["sublayers"], cfg["blocks"])
    assert len(quick["schedules"]) == len(cfg["rows"]) * len(cfg["features"])
    for row in quick["schedules"]:
        assert row["max_diff"] <= block.TOLERANCE and row["max_err_ref"] <= block.TOLERANCE
        assert row["onepass_ms"] > 0 and row["twophase_ms"] > 0 and row["phase1_ms"] > 0 and row["copy_GBps"] > 0
        assert row["onepass_bytes"] == block.onepass_bytes(terms, row["rows"], row["features"])
        assert row["twophase_bytes"] == block.twophase_bytes(terms, row["rows"], row["features"])
        assert row["twophase_calls"] == cfg["sublayers"] + cfg["sublayers"] // row["block_size"]


def test_quick_history(quick):
    """L=12, N=8: B=2, six blocks. Full: 13 tensors; Block: v_0, five blocks, P_11, v_12, P_12."""
    cfg = quick["config"]["history"]
    tensor = cfg["rows"] * cfg["features"] * 4
    (row,) = quick["history"]
    assert row["sublayers"] == 12 and row["block_size"] == 2
    assert row["full_bytes"] == 13 * tensor and row["block_bytes"] == 9 * tensor
    assert row["full_terms"] == 13 and row["block_terms"] == 7
    assert 0 < row["block_measured"] < row["full_measured"]
    # original < block holds by ~3 MiB alone, but a thread pool starting late inside the measured
    # forward of a loaded runner has added ~3.6 MiB to the original's reading: compare with Full
    assert row["original_measured"] < row["full_measured"]


def test_quick_table_and_plots(quick, tmp_path):
    text = block.table(quick)
    for header in ("1p ms", "2p ms", "2p/1p", "phase1 ms", "1p MB", "2p MB", "2p GB/s", "copy GB/s", "full MiB",
                   "block MiB", "meas block/full"):
        assert header in text
    paths = block.plot(quick, tmp_path)
    assert [p.name for p in paths] == ["block_schedules.png", "block_history.png"]
    assert all(p.stat().st_size > 0 for p in paths)
