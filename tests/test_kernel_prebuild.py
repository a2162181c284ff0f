"""Background kernel builds of a cold rewrite (kernels/prebuild.py): the kernels predicted from the
rewritten graph are exactly those its forward looks up, a verified rewrite finds them all in the
disk cache (one stderr line, none per kernel), and a worker that fails leaves the in-process build
to do the work as before (its line per kernel), with the same verdict. A cold `convert` of a deep
enough decoder starts its builder before the trace (it imports TVM meanwhile); a warm one starts none."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import transformers as tf

import attnres_compile as ac
from attnres_compile.kernels import cache as kernel_cache
from attnres_compile.kernels import fused, prebuild
from samples.models import GPT, _tokens


@pytest.fixture
def cold_cache(tmp_path, monkeypatch):
    """An empty kernel cache and no kernel in memory."""
    monkeypatch.setenv("ATTNRES_KERNEL_CACHE", str(tmp_path / "kc"))
    monkeypatch.setattr(kernel_cache, "_MEMORY", {})
    monkeypatch.setattr(kernel_cache, "_FOLDERS", {})
    monkeypatch.setattr(fused, "_KERNELS", {})
    if not fused.available():
        pytest.skip("TVM is not usable here")


@pytest.fixture
def cold(cold_cache, monkeypatch):
    """cold_cache, with the small model's 6 kernels going to the workers too."""
    monkeypatch.setattr(prebuild, "MIN_SPECS", 1)


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


def _convert(layers: int, capsys, events: list, monkeypatch):
    """A tiny Llama of `layers` layers converted, and the "compiling" lines; `events` records each
    worker start and the trace."""
    from attnres_compile.hf import trace

    started, traced = prebuild.Worker.__init__, trace.rewrite
    monkeypatch.setattr(prebuild.Worker, "__init__", lambda self, *a: events.append("worker") or started(self, *a))
    monkeypatch.setattr(trace, "rewrite", lambda *a, **k: events.append("trace") or traced(*a, **k))
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=layers, num_attention_heads=2,
                                               num_key_value_heads=1)).eval()
    converted = ac.convert(model, ac.AttnResConfig(variant="full"))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("attnres-compile: compiling")]
    return converted, lines


def test_a_cold_conversion_starts_its_builder_before_the_trace(cold_cache, capsys, monkeypatch):
    """4 layers (8 sublayers): one builder per core beyond the trace's, started before it, takes every
    kernel; the forward finds them all on disk, and the cache now reads as warm for this width."""
    events: list[str] = []
    _, lines = _convert(4, capsys, events, monkeypatch)
    assert events.index("worker") < events.index("trace"), events
    assert len(lines) == 1 and "background process" in lines[0], lines
    assert all(kernel_cache.cached(s) for s in kernel_cache._MEMORY) and not kernel_cache.PENDING
    assert prebuild.early(4, 32, "float32") == []


def test_no_early_builder_for_a_shallow_decoder_or_a_warm_width(cold_cache, tmp_path):
    """3 layers (6 sublayers): too few kernels to repay a worker's TVM import before the trace; a cache
    holding a kernel of this width and dtype (another thread count's folder counts) is taken as warm."""
    assert prebuild.early(3, 32, "float32") == []
    probe = kernel_cache.path(kernel_cache.Spec("forward", 5, 3, 48, "float32", 1e-6, 5.0, "cpu", 2))
    probe.parent.mkdir(parents=True)
    probe.write_bytes(b"")
    assert prebuild.early(8, 48, "float32") == []
    workers = prebuild.early(8, 40, "float32")
    assert len(workers) == len(os.sched_getaffinity(0)) - 1
    prebuild.stop(workers)


@pytest.mark.parametrize(("missing", "early", "late", "head"), [(8, 1, 0, 8), (3, 1, 0, 3), (25, 1, 1, 16),
                                                                  (30, 0, 2, 0), (7, 0, 1, 0)])
def test_late_workers_take_the_tail_less_their_import(missing, early, late, head, monkeypatch):
    """On 2 cores: an early worker keeps what one more would not repay; a late one takes the tail, six
    fewer specs (its import) than the early one."""
    monkeypatch.setattr(prebuild.os, "sched_getaffinity", lambda pid: {0, 1})
    assert prebuild._late_workers(missing, early) == (late, head)


def test_an_early_worker_with_nothing_to_build_ends(cold_cache):
    worker = prebuild.Worker()
    assert prebuild.start([], [worker]) == [] and worker.proc.poll() is not None
