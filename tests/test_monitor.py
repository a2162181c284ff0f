"""Depth-attention monitor: weights watched in the training forward (fused and eager kernels, no
second forward, nothing on other steps), entropy at init, collapse flags and the controller acting
on a planted collapse, original-model RMS, CSV/TensorBoard logs and plots, checkpoint inspection.
The reduction over processes is checked in tests/test_distributed.py (one gloo spawn for both)."""

import contextlib
import copy
import logging
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from attnres_compile import AttnResConfig, rewrite
from attnres_compile.ops import depth_attention as op
from attnres_compile.kernels import fused
from attnres_compile.monitor import (CollapseController, DepthMonitor, find_collapse, format_stats, inspect_weights,
                                     log_stats, read_csv, record, trace_sites)
from attnres_compile.training import param_groups
from samples.models import GPT


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = GPT(vocab=32, dim=16, layers=2, heads=2, max_len=8).eval()
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    return model, x


def _rewritten(model, x, **config):
    return rewrite(model, (x,), AttnResConfig(**config)).graph_module


@pytest.fixture(scope="module")
def full(gpt):
    """The GPT rewritten to Full AttnRes (zero queries); tests that change it take a copy."""
    return _rewritten(*gpt, variant="full")


@pytest.fixture(scope="module")
def block(gpt):
    return _rewritten(*gpt, variant="block", num_blocks=2)


def _randomised(gm, std=3.0):
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in gm.get_submodule("attnres").parameters():
            p.normal_(std=std, generator=gen)
    return gm


def _sources(gm, x):
    """{number of sources: the sources of that call} of one forward (Full: one call per count)."""
    seen = {}
    with op.observe(lambda sources, query, eps, dim, out: seen.__setitem__(len(sources), [s.clone() for s in sources])):
        with torch.no_grad():
            gm(x)
    return seen


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


@pytest.mark.parametrize("kernel", ["tvm", "eager"])
def test_watched_training_step_sees_the_weights_the_op_used(gpt, full, kernel, monkeypatch):
    """A watched step, forward and backward under autograd, records each site's weights as the
    op computes them (checked against softmax(w . RMSNorm(s_i)) written out here, from the sources
    the op was given), with the fused kernels and with the eager reference; the output and the
    gradients are those of an unwatched step, and an unwatched step records nothing."""
    if kernel == "tvm" and not fused.available():
        pytest.skip("TVM is not installed")
    model, x = gpt
    gm = _randomised(copy.deepcopy(full))
    fused_calls = []
    forward = fused.forward
    monkeypatch.setattr(fused, "forward", lambda *a: fused_calls.append(1) or forward(*a))
    previous = op.set_kernel(kernel)
    try:
        monitor = DepthMonitor(gm, every=2)
        ref = gm(x)
        ref.square().sum().backward()
        ref_grads = [p.grad.clone() for p in gm.parameters()]
        gm.zero_grad()
        with monitor.watch(3) as watched:  # not a watched step (every=2): nothing is observed
            gm(x)
        assert watched is False and monitor.stats()["sites"] == [] and monitor.history == []
        with monitor.watch(4) as watched:
            out = gm(x)
            out.square().sum().backward()
        sources = _sources(gm, x)
    finally:
        op.set_kernel(previous)
    assert watched is True and torch.equal(out, ref)
    assert all(torch.equal(p.grad, g) for p, g in zip(gm.parameters(), ref_grads))
    assert bool(fused_calls) == (kernel == "tvm")
    stats = monitor.stats()
    assert stats["step"] == 4 and monitor.history == [stats]
    assert [(s["chain"], s["site"], s["sources"], s["rows"]) for s in stats["sites"]] == [("chain0", k, k + 1, 16) for k in range(1, 5)]
    for s in stats["sites"]:
        srcs = sources[s["sources"]]
        keys = torch.stack([v * torch.rsqrt(v.double().square().mean(-1, keepdim=True) + 1e-6) for v in srcs]).double()
        w = gm.get_parameter(s["name"]).detach().double()
        p = torch.softmax(keys @ w, dim=0).flatten(1)  # [sources, rows]
        assert s["weights"] == pytest.approx(p.mean(1).tolist(), abs=1e-6)
        assert s["weights_max"] == pytest.approx(p.amax(1).tolist(), abs=1e-6)
        assert s["entropy"] == pytest.approx(float(-(p * p.log()).sum(0).mean()), abs=1e-5)
        assert s["entropy"] < 0.9 * s["max_entropy"]  # randomised queries: far from uniform, so this checks something
        value = torch.ops.attnres.depth_attention(srcs, w.float(), 1e-6, float(s["sources"]), -1)
        assert s["rms"] == pytest.approx(float(value.double().square().mean().sqrt()), rel=1e-5)


def test_recomputed_sites_count_once(gpt, block):
    """Activation checkpointing re-runs the sites in the backward: the monitor counts them once."""
    gm, x = block, gpt[1]
    monitor = DepthMonitor(gm)
    with monitor.watch(0):
        torch.utils.checkpoint.checkpoint(gm, x, use_reentrant=False).sum().backward()
    rows = [s["rows"] for s in monitor.stats()["sites"]]
    assert rows == [16] * 4


def test_entropy_at_init_is_log_sources(gpt, full):
    stats = record(full, [gpt[1], gpt[1]])
    assert [s["sources"] for s in stats["sites"]] == [2, 3, 4, 5]  # Full: site k reads v_0..v_k
    for s in stats["sites"]:
        assert s["rows"] == 32
        assert s["entropy"] == pytest.approx(math.log(s["sources"]), abs=1e-6)
        assert s["weights"] == pytest.approx([1 / s["sources"]] * s["sources"])
    assert find_collapse(stats) == []
    assert "chain0" in format_stats(stats)


def test_keyword_inputs_and_refusals(gpt):
    model, x = gpt
    gm = rewrite(model, {"idx": x}, AttnResConfig()).graph_module
    monitor = DepthMonitor(gm)
    with torch.no_grad():
        torch.testing.assert_close(monitor(idx=x), gm(idx=x))
    assert len(monitor.stats()["sites"]) == 4
    with pytest.raises(ValueError, match="no site to monitor"):
        DepthMonitor(model)
    with pytest.raises(ValueError, match="every=0: give a whole number"):
        DepthMonitor(gm, every=0)


def test_original_rms_matches_preserve_rewrite_at_init(gpt, full):
    model, x = gpt
    gm0, sites = trace_sites(model, (x,))
    original = record(gm0, [x], sites)
    rewritten = record(full, [x])
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


def _plant(gm, x, site: int, source: int, gain: float = 30.0) -> None:
    """Set chain0's site `site` query to `gain` x the unit mean key direction of its source
    `source`: on these tokens that source's logit leads every other's by >= 0.4 x gain."""
    srcs = _sources(gm, x)[site + 1]
    keys = torch.stack([s * torch.rsqrt(s.square().mean(-1, keepdim=True) + 1e-6) for s in srcs])
    u = keys[source].flatten(0, -2).mean(0)
    with torch.no_grad():
        gm.get_parameter(f"attnres.chain0.site{site}").copy_(gain * u / u.norm())


def test_controller_slows_the_collapsed_site_only(gpt, full, tmp_path, caplog):
    """A collapse planted at site 3 (one source takes ~all its weight) is flagged on the watched
    step; the controller then scales that site's query steps by its factor (0: frozen) while every
    other parameter steps as with a plain optimizer (a twin trained beside it, bitwise)."""
    x = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(2))
    gm = copy.deepcopy(full).train()
    _plant(gm, x, site=3, source=1)
    arms = {name: copy.deepcopy(gm) for name in ("plain", "x0.1", "frozen")}
    opts = {name: torch.optim.AdamW(param_groups(m, lr=1e-2, weight_decay=0.01, query_lr=1e-2), lr=1e-2) for name, m in arms.items()}
    controllers = {"x0.1": CollapseController(opts["x0.1"], arms["x0.1"], factor=0.1),
                   "frozen": CollapseController(opts["frozen"], arms["frozen"], factor=0.0)}
    monitor = DepthMonitor(arms["x0.1"], csv=tmp_path / "w.csv")
    before = {}
    for step in range(2):
        before[step] = {name: {n: p.detach().clone() for n, p in m.named_parameters()} for name, m in arms.items()}
        for name, m in arms.items():
            with monitor.watch(step) if name == "x0.1" else contextlib.nullcontext():
                loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
            loss.backward()
            opts[name].step()
            opts[name].zero_grad()
        if step == 0:
            stats = monitor.stats()
            assert [(f["kind"], f["site"]) for f in find_collapse(stats)] == [("site", 3)]
            assert stats["sites"][2]["weights"][1] > 0.999
            with caplog.at_level(logging.WARNING, logger="attnres_compile.monitor"):
                actions = {name: c.update(stats) for name, c in controllers.items()}
            assert [(a["chain"], a["site"], a["action"]) for a in actions["x0.1"]] == [("chain0", 3, "steps x0.1")]
            assert [a["action"] for a in actions["frozen"]] == ["frozen"]
            assert "chain0 site 3 collapsed" in caplog.text
    # step 0: nobody scaled; step 1: site 3's query moves by factor x the plain step, the rest bitwise as plain
    plain = {n: p.detach() for n, p in arms["plain"].named_parameters()}
    for name, factor in (("x0.1", 0.1), ("frozen", 0.0)):
        for n, p in arms[name].named_parameters():
            if n == "attnres.chain0.site3":
                old = before[1][name][n]
                step, plain_step = p.detach() - old, plain[n] - before[1]["plain"][n]
                assert plain_step.abs().min() > 1e-3
                torch.testing.assert_close(step, factor * plain_step, atol=2e-6, rtol=0)
            else:
                assert torch.equal(p.detach(), plain[n]), (name, n)
    assert [h["step"] for h in read_csv(tmp_path / "w.csv")] == [0, 1]


def test_csv_round_trip_and_plot_over_steps(gpt, block, tmp_path):
    pytest.importorskip("matplotlib")
    from attnres_compile.utils.plots import plot_weights_over_steps

    gm, x = copy.deepcopy(block), gpt[1]
    opt = torch.optim.Adam(gm.parameters(), lr=0.05)
    monitor = DepthMonitor(gm, every=2, csv=tmp_path / "w.csv")
    for step in range(5):
        with monitor.watch(step):
            loss = gm(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert [h["step"] for h in monitor.history] == [0, 2, 4]
    logged = read_csv(tmp_path / "w.csv")
    assert len(logged) == 3
    for got, ref in zip(logged, monitor.history):
        for a, b in zip(got["sites"], ref["sites"]):
            assert (a["chain"], a["site"], a["rows"], a["sources"]) == (b["chain"], b["site"], b["rows"], b["sources"])
            assert a["weights"] == pytest.approx(b["weights"], rel=1e-5)
            assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-5)
    assert monitor.history[-1]["sites"][0]["weights"] != pytest.approx(monitor.history[0]["sites"][0]["weights"], abs=1e-3)
    plot_weights_over_steps(logged, tmp_path / "steps.png")
    assert (tmp_path / "steps.png").stat().st_size > 0


def test_inspect_weights_from_checkpoint(gpt, block, tmp_path):
    pytest.importorskip("matplotlib")
    gm, x = block, gpt[1]
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(gm, (x,), strict=False), str(path))
    result = inspect_weights(path, tmp_path / "weights.png")
    assert (tmp_path / "weights.png").stat().st_size > 0
    assert result["collapse"] == []
    expected = record(gm, [x])
    assert [s["weights"] for s in result["stats"]["sites"]] == [s["weights"] for s in expected["sites"]]
    other = torch.randint(0, 32, (2, 8))
    assert inspect_weights(path, inputs=(other,))["stats"]["sites"][0]["rms"] == pytest.approx(record(gm, [other])["sites"][0]["rms"])


def test_tensorboard_and_plots(gpt, full, tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("matplotlib")
    from attnres_compile.monitor import tensorboard_writer
    from attnres_compile.utils.plots import plot_magnitude

    gm, x = full, gpt[1]
    writer = tensorboard_writer(tmp_path / "tb")
    monitor = DepthMonitor(gm, tensorboard=writer)
    with monitor.watch(0), torch.no_grad():
        gm(x)
    writer.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    stats = monitor.stats()
    log_stats(None, stats, step=0)  # no writer: no-op
    plot_magnitude({"rewritten": [s["rms"] for s in stats["sites"]]}, tmp_path / "mag.png")
    assert (tmp_path / "mag.png").stat().st_size > 0


# ---------------------------------------------------------------------------------------------
# issue 62 items 7 and 8: the log never truncates a file it was not told to; nonsense is refused


def test_an_existing_file_is_never_truncated(full, tmp_path):
    """DepthMonitor(gm, csv=PATH) and CsvLog(PATH) truncated any file at PATH."""
    from attnres_compile.monitor import CsvLog

    mine = tmp_path / "notes.csv"
    mine.write_text("precious,data\n1,2\n")
    with pytest.raises(FileExistsError, match=f"{mine} exists"):
        DepthMonitor(full, csv=mine)
    with pytest.raises(FileExistsError, match="not a depth-weight log"):
        CsvLog(mine, append=True)
    assert mine.read_text() == "precious,data\n1,2\n"
    folder = tmp_path / "folder.csv"
    folder.mkdir()
    with pytest.raises(ValueError, match="is a folder"):
        CsvLog(folder, overwrite=True)
    CsvLog(mine, overwrite=True)  # asked for
    assert mine.read_text().startswith("step,chain,site")


def test_a_log_of_ours_continues_only_when_asked(full, gpt, tmp_path):
    from attnres_compile.monitor import CsvLog

    path = tmp_path / "w.csv"
    monitor = DepthMonitor(full, csv=path)
    with monitor.watch(0):
        full(gpt[1])
    with pytest.raises(FileExistsError, match="append=True"):
        DepthMonitor(full, csv=path)
    resumed = DepthMonitor(full, csv=CsvLog(path, append=True))
    with resumed.watch(1):
        full(gpt[1])
    assert [h["step"] for h in read_csv(path)] == [0, 1]
    DepthMonitor(full, csv=path, overwrite=True)
    assert read_csv(path) == []


@pytest.mark.parametrize("every", [float("nan"), float("inf"), 2.5, 0, -1, True, "5", None])
def test_every_must_be_a_whole_number_of_steps(full, every):
    """DepthMonitor(gm, every=nan) watched nothing and stats() stayed silently empty."""
    with pytest.raises(ValueError, match="every="):
        DepthMonitor(full, every=every)
