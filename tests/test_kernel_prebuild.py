"""Background kernel builds of a cold rewrite (kernels/prebuild.py): the kernels predicted from the
rewritten graph are exactly those its forward looks up, a verified rewrite finds them all in the
disk cache (one stderr line, none per kernel), and a worker that fails leaves the in-process build
to do the work as before (its line per kernel), with the same verdict."""

from __future__ import annotations

import sys

import pytest
import torch

import attnres_compile as ac
from attnres_compile.kernels import cache as kernel_cache
from attnres_compile.kernels import fused, prebuild
from samples.models import GPT, _tokens


@pytest.fixture
def cold(tmp_path, monkeypatch):
    """An empty kernel cache and no kernel in memory."""
    monkeypatch.setenv("ATTNRES_KERNEL_CACHE", str(tmp_path / "kc"))
    monkeypatch.setattr(kernel_cache, "_MEMORY", {})
    monkeypatch.setattr(kernel_cache, "_FOLDERS", {})
    monkeypatch.setattr(fused, "_KERNELS", {})
    monkeypatch.setattr(prebuild, "MIN_SPECS", 1)  # the small model's 6 kernels go to the workers too
    if not fused.available():
        pytest.skip("TVM is not usable here")


@pytest.mark.parametrize("shape", [(2, 3, 16), (1024, 576)])
def test_predicted_kernels_are_the_ones_the_forward_looks_up(shape, monkeypatch):
    """Every count 1..40 (per-count kernels, then the partial chain and its merge), on a small
    call (one thread) and on one big enough for TVM's pool where torch has threads."""
    if not fused.available():
        pytest.skip("TVM is not usable here")
    monkeypatch.setattr(fused, "_run", lambda *args: None)
    looked_up = []
    monkeypatch.setattr(fused, "_lookup", lambda key: looked_up.append(key) or True)
    like = torch.empty((), dtype=torch.float32).expand(*shape)
    for count in range(1, 41):
        looked_up.clear()
        fused.forward([like] * count, torch.zeros(shape[-1]), 1e-6, float(count), -1)
        assert [(k[0], k[1], k[9], k[8]) for k in looked_up] == \
            prebuild._forward_keys(fused, count, like, float(count)), count


def _rewrite(capsys):
    torch.manual_seed(0)
    model, example = GPT(dim=32, layers=3, heads=2).eval(), _tokens()
    result = ac.rewrite(model, example, ac.AttnResConfig())
    assert all(row["ok"] for row in result.report.data["verification"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("attnres-compile: compiling")]
    return result.graph_module, lines


def test_a_cold_rewrite_builds_its_kernels_in_the_background(cold, capsys):
    gm, lines = _rewrite(capsys)
    specs = prebuild.forward_specs(gm)
    assert len(lines) == 1 and "background process" in lines[0], lines
    assert set(kernel_cache._MEMORY) == set(specs) and all(kernel_cache.cached(s) for s in specs)
    assert not kernel_cache.PENDING


def test_a_failing_worker_leaves_the_build_in_process(cold, capsys, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the workers exit at once, having built nothing
    gm, lines = _rewrite(capsys)
    specs = prebuild.forward_specs(gm)
    assert "background process" in lines[0] and len(lines) == 1 + len(specs), lines
    assert set(kernel_cache._MEMORY) == set(specs) and not kernel_cache.PENDING
