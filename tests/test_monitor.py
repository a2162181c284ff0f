"""Depth-attention monitor: weights, entropy at init, collapse flags, original-model RMS, checkpoint inspection."""

import math

import pytest
import torch
from torch import nn

from attnres_compile import AttnResConfig, rewrite
from attnres_compile.monitor import (DepthMonitor, depth_weights, find_collapse, format_stats, inspect_weights, log_stats,
                                     record, trace_sites)
from samples.models import GPT


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = GPT(vocab=32, dim=16, layers=2, heads=2, max_len=8).eval()
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    return model, x


def _rewritten(model, x, **config):
    return rewrite(model, (x,), AttnResConfig(**config)).graph_module


class Toy(nn.Module):
    """h = x + f1(x); h = h + f2(h), with constant branches f1 = +1 and f2 = -1 (zero weights, fixed biases)."""

    def __init__(self):
        super().__init__()
        self.f1, self.f2 = nn.Linear(4, 4), nn.Linear(4, 4)
        for f, b in ((self.f1, 1.0), (self.f2, -1.0)):
            nn.init.zeros_(f.weight)
            nn.init.constant_(f.bias, b)

    def forward(self, x):
        h = x + self.f1(x)
        return h + self.f2(h)


def test_weights_sum_to_one_and_graph_unchanged(gpt):
    model, x = gpt
    gm = _rewritten(model, x, variant="block", num_blocks=2)
    with torch.no_grad():
        for p in gm.get_submodule("attnres").parameters():
            p.normal_(std=3.0)
    monitor = DepthMonitor(gm)
    torch.testing.assert_close(monitor(x), gm(x))
    stats = monitor.stats()
    assert len(stats["sites"]) == 4
    for s in stats["sites"]:
        assert math.isclose(sum(s["weights"]), 1.0, rel_tol=1e-6)
        assert all(0 <= w <= m <= 1 for w, m in zip(s["weights"], s["weights_max"]))
        assert s["entropy"] < s["max_entropy"]
    p = depth_weights([torch.randn(3, 5, 16) for _ in range(4)], torch.randn(16), 1e-6, -1)
    torch.testing.assert_close(p.sum(0), torch.ones(3, 5))


def test_keyword_inputs(gpt):
    model, x = gpt
    gm = rewrite(model, {"idx": x}, AttnResConfig()).graph_module
    monitor = DepthMonitor(gm)
    torch.testing.assert_close(monitor(idx=x), gm(idx=x))
    assert len(monitor.stats()["sites"]) == 4


def test_entropy_at_init_is_log_sources(gpt):
    model, x = gpt
    stats = record(_rewritten(model, x, variant="full"), [x, x])
    assert stats["batches"] == 2
    assert [s["sources"] for s in stats["sites"]] == [2, 3, 4, 5]  # Full: site k reads v_0..v_k
    for s in stats["sites"]:
        assert s["entropy"] == pytest.approx(math.log(s["sources"]), abs=1e-6)
        assert s["weights"] == pytest.approx([1 / s["sources"]] * s["sources"])
    assert find_collapse(stats) == []
    assert "chain0" in format_stats(stats)


def test_original_rms_matches_preserve_rewrite_at_init(gpt):
    model, x = gpt
    gm0, sites = trace_sites(model, (x,))
    original = record(gm0, [x], sites)
    rewritten = record(_rewritten(model, x, variant="full"), [x])
    assert [s["site"] for s in original["sites"]] == [1, 2, 3, 4]
    assert "weights" not in original["sites"][0]
    assert [s["rms"] for s in original["sites"]] == pytest.approx([s["rms"] for s in rewritten["sites"]], rel=1e-5)


def test_collapse_flags_dead_source_and_collapsed_sites():
    toy = Toy().eval()
    gm = _rewritten(toy, torch.full((3, 4), 2.0), variant="full")
    with torch.no_grad():
        for p in gm.get_submodule("attnres").parameters():
            p.fill_(5.0)  # logit +20 for a positive constant source, -20 for a negative one
    # x = +2: v_0 and v_1 share the weight, v_2 (= -1) gets e^-40: one dead source, no collapsed site
    stats = record(gm, [torch.full((3, 4), 2.0)])
    flags = find_collapse(stats)
    assert [(f["kind"], f["source"], f["sites"]) for f in flags] == [("source", 2, [2])]
    assert flags[0]["max_weight"] < 1e-12
    assert stats["sites"][1]["weights"] == pytest.approx([0.5, 0.5, 0.0], abs=1e-5)
    # x = -2: v_1 takes all the weight at both sites: both sites collapse, v_0 and v_2 are dead
    flags = find_collapse(record(gm, [torch.full((3, 4), -2.0)]))
    assert [(f["kind"], f.get("site", f.get("source"))) for f in flags] == [("site", 1), ("site", 2), ("source", 0), ("source", 2)]


def test_inspect_weights_from_checkpoint(gpt, tmp_path):
    pytest.importorskip("matplotlib")
    model, x = gpt
    gm = _rewritten(model, x, variant="block", num_blocks=2)
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(gm, (x,), strict=False), str(path))
    result = inspect_weights(path, tmp_path / "weights.png")
    assert (tmp_path / "weights.png").stat().st_size > 0
    assert result["collapse"] == []
    expected = record(gm, [x])
    assert [s["weights"] for s in result["stats"]["sites"]] == [s["weights"] for s in expected["sites"]]
    other = torch.randint(0, 32, (2, 8))
    assert inspect_weights(path, inputs=(other,))["stats"]["sites"][0]["rms"] == pytest.approx(record(gm, [other])["sites"][0]["rms"])


def test_tensorboard_and_plots(gpt, tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("matplotlib")
    from attnres_compile.monitor import tensorboard_writer
    from attnres_compile.plots import plot_magnitude

    model, x = gpt
    stats = record(_rewritten(model, x, variant="full"), [x])
    writer = tensorboard_writer(tmp_path / "tb")
    log_stats(writer, stats, step=0)
    writer.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    log_stats(None, stats, step=0)  # no writer: no-op
    plot_magnitude({"rewritten": [s["rms"] for s in stats["sites"]]}, tmp_path / "mag.png")
    assert (tmp_path / "mag.png").stat().st_size > 0
