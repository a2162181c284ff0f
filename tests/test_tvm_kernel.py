"""The TVM depth-attention kernels against a float64 numpy reference of the formula:

    r_i = sqrt(mean_d s_i^2 + eps),  z_i = w.s_i / r_i,  p = softmax_i(z),  out = scale * sum_i p_i s_i
"""

from __future__ import annotations

import functools
import re
import shutil

import ml_dtypes
import numpy as np
import pytest
import tvm

from attnres_compile.kernels import tir_pipeline
from attnres_compile.kernels.schedule import build, schedule_cpu
from attnres_compile.kernels.target import host_target, vector_bits
from attnres_compile.kernels.tensorir import (
    BLOCK_MAJOR,
    depth_attention_backward_func,
    depth_attention_func,
    depth_attention_merge_func,
    depth_attention_merge_indexed_func,
    depth_attention_norm_backward_func,
    depth_attention_norm_func,
    depth_attention_partial_func,
)

NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# Relative to the output's magnitude. float32: accumulation order only. Reduced precision: the
# reference sees the same rounded inputs, so the error is the final rounding of the output to
# the storage dtype (half an ulp: 2^-11 for float16, 2^-8 for bfloat16) plus float32 noise.
TOLERANCE = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}
CUDA = {"kind": "cuda", "arch": "sm_90"}


def reference(sources, w, eps, scale):
    v = np.stack([s.astype(np.float64) for s in sources])
    r = np.sqrt((v**2).mean(-1) + eps)
    z = np.einsum("d,s...d->s...", w.astype(np.float64), v) / r
    p = np.exp(z - z.max(0))
    p /= p.sum(0)
    return scale * np.einsum("s...,s...d->...d", p, v)


def backward_reference(sources, w, g, eps, scale):
    """(d out / d sources, d out / d w) for the upstream gradient g, float64 (ops/depth_attention.py's formula)."""
    v = np.stack([s.astype(np.float64) for s in sources])
    w, g = w.astype(np.float64), g.astype(np.float64)
    rinv = 1 / np.sqrt((v**2).mean(-1) + eps)
    z = np.einsum("d,s...d->s...", w, v) * rinv
    p = np.exp(z - z.max(0))
    p /= p.sum(0)
    u = np.einsum("...d,s...d->s...", g, v)
    dz = scale * p * (u - (p * u).sum(0))
    ds = scale * p[..., None] * g + (dz * rinv)[..., None] * w - (dz * z * rinv**2 / v.shape[-1])[..., None] * v
    return list(ds), ((dz * rinv)[..., None] * v).reshape(-1, v.shape[-1]).sum(0)


@functools.cache
def _compiled(kind: str, *args):
    make = {
        "main": depth_attention_func,
        "partial": depth_attention_partial_func,
        "merge": depth_attention_merge_func,
        "backward": depth_attention_backward_func,
        "backward_chunk": functools.partial(depth_attention_backward_func, chunk=True),
    }[kind]
    return build(make(*args), host_target(2))


def _sources(rng, count, rows, size, dtype):
    rows = rows if isinstance(rows, tuple) else (rows,)
    return [rng.standard_normal((*rows, size)).astype(NP_DTYPES[dtype]) for _ in range(count)]


def _query(rng, size):
    return (rng.standard_normal(size) / np.sqrt(size)).astype(np.float32)  # logits of order 1


def _run(module, *arrays):
    tensors = [tvm.runtime.tensor(a) for a in arrays]
    module(*tensors)
    return tensors


def _assert_close(out, ref, dtype):
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=0, atol=TOLERANCE[dtype] * np.abs(ref).max())


@pytest.mark.parametrize(
    "num_sources, size, rows, dtype",
    [
        (1, 77, 3, "float32"),
        (9, 64, 130, "float32"),
        (4, 77, 130, "float32"),
        (65, 77, 3, "float32"),
        (9, 1024, 3, "float32"),
        (9, 77, 130, "float16"),
        (65, 64, 3, "float16"),
        (3, 96, 5, "bfloat16"),
    ],
)
def test_depth_attention_matches_reference(num_sources, size, rows, dtype):
    rng = np.random.default_rng(num_sources * 1000 + size)
    srcs, w = _sources(rng, num_sources, rows, size, dtype), _query(rng, size)
    out = np.zeros((rows, size), NP_DTYPES[dtype])
    result = _run(_compiled("main", num_sources, size, dtype), *srcs, w, out)[-1].numpy()
    assert result.dtype == NP_DTYPES[dtype]
    _assert_close(result, reference(srcs, w, 1e-6, num_sources), dtype)


@pytest.mark.parametrize(
    "num_sources, size, rows, dtype",
    [(3, 77, 130, "float32"), (9, 64, (3, 17), "float32"), (1, 16, 1, "float32"), (4, 96, 33, "bfloat16"),
     (2, 40, (2, 3), "float16")],
)
def test_backward_matches_reference(num_sources, size, rows, dtype):
    """The fused backward (two row chunks with their own partial dw; rows fewer than chunks
    included) against float64. Tolerances relative to each gradient's magnitude, as the forward's;
    dw is accumulated and stored in float32."""
    rng = np.random.default_rng(num_sources * 100 + size)
    srcs, w = _sources(rng, num_sources, rows, size, dtype), _query(rng, size)
    g = _sources(rng, 1, rows, size, dtype)[0]
    scale = float(num_sources)
    outs = [np.zeros_like(s) for s in srcs] + [np.zeros(size, np.float32)]
    rank = srcs[0].ndim
    module = _compiled("backward", num_sources, size, dtype, 1e-6, scale, rank)
    *grads, dw = [t.numpy() for t in _run(module, *srcs, w, g, *outs)[num_sources + 2:]]
    ref_grads, ref_dw = backward_reference(srcs, w, g, 1e-6, scale)
    for got, ref in zip(grads, ref_grads):
        assert got.dtype == NP_DTYPES[dtype]
        _assert_close(got, ref, dtype)
    if num_sources > 1:  # one source: dw = 0 exactly
        _assert_close(dw, ref_dw, "float32")
    else:
        assert not np.any(dw)


@pytest.mark.parametrize("rows, dtype", [(130, "float32"), ((3, 17), "float32"), (33, "bfloat16")])
def test_backward_chunk_matches_its_share_of_the_whole_backward(rows, dtype):
    """Sources 3..7 of 11, given the softmax state of all 11 (m, l, ubar, float64 here): their
    gradients and their share of dw, against the whole float64 backward; the scale folded into l
    (l / c and the kernel's scale 1, as fused.py calls it) gives the same as the scale itself."""
    rng = np.random.default_rng(11)
    srcs, w = _sources(rng, 11, rows, 64, dtype), _query(rng, 64) * 4
    g = _sources(rng, 1, rows, 64, dtype)[0]
    v = np.stack([s.astype(np.float64) for s in srcs])
    rinv = 1 / np.sqrt((v**2).mean(-1) + 1e-6)
    z = np.einsum("d,s...d->s...", w.astype(np.float64), v) * rinv
    m = z.max(0)
    e = np.exp(z - m)
    l = e.sum(0)
    ubar = (e * np.einsum("...d,s...d->s...", g.astype(np.float64), v)).sum(0) / l
    ref_grads, _ = backward_reference(srcs, w, g, 1e-6, 11.0)
    chunk = slice(3, 8)
    ref_dw = ((11.0 * e / l * (np.einsum("...d,s...d->s...", g.astype(np.float64), v) - ubar) * rinv)[chunk][..., None]
              * v[chunk]).reshape(-1, 64).sum(0)
    for scale, given_l in ((11.0, l), (1.0, l / 11.0)):
        outs = [np.zeros_like(s) for s in srcs[chunk]] + [np.zeros(64, np.float32)]
        module = _compiled("backward_chunk", 5, 64, dtype, 1e-6, scale, srcs[0].ndim)
        stats = [a.astype(np.float32) for a in (m, given_l, ubar)]
        *grads, dw = [t.numpy() for t in _run(module, *srcs[chunk], w, g, *stats, *outs)[5 + 5:]]
        for got, ref in zip(grads, ref_grads[chunk]):
            assert got.dtype == NP_DTYPES[dtype]
            _assert_close(got, ref, dtype)
        _assert_close(dw, ref_dw, "float32")


def test_rank3_forward_matches_reference():
    """[B, T, D] sources as they are (symbolic row dims, fused by the schedule)."""
    rng = np.random.default_rng(5)
    srcs, w = _sources(rng, 4, (3, 37), 77, "float32"), _query(rng, 77)
    out = np.zeros((3, 37, 77), np.float32)
    result = _run(_compiled("main", 4, 77, "float32", 1e-6, None, 3), *srcs, w, out)[-1].numpy()
    _assert_close(result, reference(srcs, w, 1e-6, 4), "float32")


def test_eps_scale_and_large_logits():
    rng = np.random.default_rng(1)
    srcs = _sources(rng, 5, 130, 77, "float32")
    w = (4 * rng.standard_normal(77)).astype(np.float32)  # logits up to ~80: exp needs the max subtracted
    out = np.zeros((130, 77), np.float32)
    result = _run(_compiled("main", 5, 77, "float32", 0.5, 1.0), *srcs, w, out)[-1].numpy()
    _assert_close(result, reference(srcs, w, 0.5, 1.0), "float32")


def test_all_zero_sources():
    rng = np.random.default_rng(2)
    srcs, w = _sources(rng, 4, 130, 77, "float32"), _query(rng, 77)
    srcs[1][:] = 0
    srcs[3][:] = 0
    out = np.zeros((130, 77), np.float32)
    module = _compiled("main", 4, 77, "float32")
    result = _run(module, *srcs, w, out)[-1].numpy()
    _assert_close(result, reference(srcs, w, 1e-6, 4), "float32")
    zeros = [np.zeros_like(s) for s in srcs]
    assert not np.any(_run(module, *zeros, w, out)[-1].numpy())


@pytest.mark.parametrize("dtype, num_blocks, first", [("float32", 3, None), ("float16", 3, None),
                                                      ("float32", BLOCK_MAJOR, None), ("bfloat16", BLOCK_MAJOR + 1, None),
                                                      ("float32", 5, 2), ("float16", BLOCK_MAJOR + 2, 2)])
def test_two_phase_matches_reference(dtype, num_blocks, first):
    """Phase 1 over J completed blocks for B queries, then phase 2 per site with its own extra
    sources, equals the single-pass op over all J + E sources (J from BLOCK_MAJOR: phase 1's sums
    block by block). With `first`, phase 1 is a chain: a partial over the first blocks, then one
    continuing its state over the rest (the TVM lowering's links; the last case block by block)."""
    num_queries, num_extra, rows, size = 2, 2, 130, 77
    rng = np.random.default_rng(3)
    blocks = _sources(rng, num_blocks, rows, size, dtype)
    queries = np.stack([_query(rng, size) for _ in range(num_queries)])
    state: list = []
    for start, end in [(0, num_blocks)] if first is None else [(0, first), (first, num_blocks)]:
        partial = _compiled("partial", end - start, num_queries, size, dtype, 1e-6, 2, bool(state))
        fresh = [np.zeros((num_queries, rows), np.float32)] * 2 + [np.zeros((num_queries, rows, size), np.float32)]
        state = [t.numpy() for t in _run(partial, *blocks[start:end], queries, *state, *fresh)[-3:]]
    m, l, acc = state
    scale = float(num_blocks + num_extra)
    merge = _compiled("merge", num_extra, size, dtype, 1e-6, scale)
    for q in range(num_queries):
        extra = _sources(rng, num_extra, rows, size, dtype)
        out = np.zeros((rows, size), NP_DTYPES[dtype])
        result = _run(merge, m[q], l[q], acc[q], *extra, queries[q], out)[-1].numpy()
        _assert_close(result, reference(blocks + extra, queries[q], 1e-6, scale), dtype)


def _layer_norm(x, gamma, beta, eps):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * gamma + beta


def _rms_norm(x, gamma, beta, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * gamma


@pytest.mark.parametrize("norm, ref_norm", [("layer", _layer_norm), ("rms", _rms_norm)])
def test_next_norm_of_the_output_is_fused(norm, ref_norm):
    """With norm_eps the site kernel and the two-phase merge store LayerNorm(out) (gamma, beta) or
    RMSNorm(out) (gamma): a PreNorm model's next norm, which the lowering fuses. The sources sit
    around +3, so the one-pass variance (sum of squares minus the squared mean) is checked where
    it cancels."""
    S, rows, size, norm_eps = 5, 37, 96, 1e-5
    rng = np.random.default_rng(11)
    srcs = [s + 3 for s in _sources(rng, S, rows, size, "float32")]
    w, gamma, beta = _query(rng, size), rng.standard_normal(size).astype(np.float32), rng.standard_normal(size).astype(np.float32)
    affine = [gamma, beta] if norm == "layer" else [gamma]
    site = build(depth_attention_func(S, size, "float32", 1e-6, 1.0, 2, norm_eps, norm), host_target(2))
    out = _run(site, *srcs, w, *affine, np.zeros((rows, size), np.float32))[-1].numpy()
    expected = ref_norm(reference(srcs, w, 1e-6, 1.0), gamma, beta, norm_eps)
    _assert_close(out, expected, "float32")
    queries = np.stack([_query(rng, size), w])
    state = [np.zeros((2, rows), np.float32), np.zeros((2, rows), np.float32), np.zeros((2, rows, size), np.float32)]
    state = [t.numpy() for t in _run(_compiled("partial", 3, 2, size, "float32"), *srcs[:3], queries, *state)[-3:]]
    merge = build(depth_attention_merge_indexed_func(2, 2, size, "float32", 1e-6, 2, norm_eps, norm), host_target(2))
    tensors = [tvm.runtime.tensor(a) for a in (*state, *srcs[3:], w, *affine, np.zeros((rows, size), np.float32))]
    merge(*tensors[:-1], 1, 1.0, tensors[-1])  # query 1, scale 1: index and scale are arguments
    _assert_close(tensors[-1].numpy(), expected, "float32")
    plain = build(depth_attention_merge_indexed_func(2, 2, size, "float32", 1e-6, 2), host_target(2))
    tensors = [tvm.runtime.tensor(a) for a in (*state, *srcs[3:], queries[0], np.zeros((rows, size), np.float32))]
    plain(*tensors[:-1], 0, 5.0, tensors[-1])  # query 0, scale 5, no norm
    _assert_close(tensors[-1].numpy(), reference(srcs, queries[0], 1e-6, 5.0), "float32")
    # constant rows at large magnitudes: sum of squares minus the squared mean rounds below zero
    levels = np.linspace(100, 5000, rows, dtype=np.float32)[:, None] + np.zeros(size, np.float32)
    out = _run(site, *[levels] * S, w, *affine, np.zeros((rows, size), np.float32))[-1].numpy()
    assert np.isfinite(out).all()


def _pair_reference(srcs, w, affine, norm, norm_eps, scale, grads):
    """float64 torch autograd of the unfused pair: (mixed, normed) and the gradients of sources, w
    and the affine parameters for the upstream (gm or None, gn)."""
    import torch

    ts = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in [*srcs, w, *affine]]
    s, q, params = ts[: len(srcs)], ts[len(srcs)], ts[len(srcs) + 1 :]
    v = torch.stack(s)
    p = ((v @ q) / torch.sqrt((v**2).mean(-1) + 1e-6)).softmax(0)
    h = scale * (p[..., None] * v).sum(0)
    if norm == "layer":
        n = torch.nn.functional.layer_norm(h, h.shape[-1:], *(params + [None, None])[:2], norm_eps)
    else:
        n = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + norm_eps) * (params[0] if params else 1)
    gm, gn = (None if g is None else torch.tensor(g, dtype=torch.float64) for g in grads)
    loss = (n * gn).sum() + (0 if gm is None else (h * gm).sum())
    return [h.detach().numpy(), n.detach().numpy()], [g.numpy() for g in torch.autograd.grad(loss, ts)]


@pytest.mark.parametrize("norm, weight, bias, with_gm", [("layer", True, True, True), ("rms", False, False, False)])
def test_site_norm_pair_forward_and_backward(norm, weight, bias, with_gm):
    """The fused pair (ops/site_norm.py): depth_attention_norm_func stores both the site's output and
    its norm; the backward, given the normed output's gradient (and the mixed output's, where it
    has readers of its own), recomputes the mixed row in cache and returns the sources', the
    query's and the weight's gradients (the bias's, sum_rows gn, is the binding's). Sources sit
    around +1 .. +3: the LayerNorm's mean matters."""
    S, rows, size, norm_eps, scale = 3, 37, 96, 1e-5, 3.0
    rng = np.random.default_rng(5)
    srcs = [s + k for k, s in enumerate(_sources(rng, S, rows, size, "float32"), start=1)]
    w = _query(rng, size)
    affine = [rng.standard_normal(size).astype(np.float32) for _ in range(weight + (bias and norm == "layer"))]
    gm, gn = (rng.standard_normal((rows, size)).astype(np.float32) for _ in range(2))
    outs, grads = _pair_reference(srcs, w, affine, norm, norm_eps, scale, (gm if with_gm else None, gn))
    forward = build(depth_attention_norm_func(S, size, "float32", 1e-6, scale, 2, norm, norm_eps, weight, bias),
                    host_target(2))
    zeros = [np.zeros((rows, size), np.float32) for _ in range(2)]
    for got, ref in zip(_run(forward, *srcs, w, *affine, *zeros)[-2:], outs):
        _assert_close(got.numpy(), ref, "float32")
    backward = build(depth_attention_norm_backward_func(S, size, "float32", 1e-6, scale, 2, norm, norm_eps, weight, bias,
                                                        with_gm), host_target(2))
    args = [*srcs, w, *affine, *([gm] if with_gm else []), gn, *[np.zeros((rows, size), np.float32)] * S,
            *[np.zeros(size, np.float32)] * (1 + weight)]
    got = [t.numpy() for t in _run(backward, *args)[-(S + 1 + weight):]]
    for g, ref in zip(got, grads[: S + 1 + weight]):
        _assert_close(g, ref, "float32")


def test_unknown_norm_is_refused():
    with pytest.raises(ValueError, match="unknown fused norm 'group'"):
        depth_attention_func(2, 8, norm_eps=1e-5, norm="group")


def test_cpu_schedule_keeps_per_row_state_only():
    """After buffer compaction every intermediate is a constant, at most one-row allocation:
    the online-softmax state and partial sums are per row, never a stacked [S, rows, D] copy."""
    func = schedule_cpu(depth_attention_func(9, 77), host_target(2))
    passes = tvm.s_tir.transform
    lower = tvm.ir.transform.Sequential(
        [
            passes.LowerInitBlock(),
            passes.PlanAndUpdateBufferAllocationLocation(),
            passes.ConvertBlocksToOpaque(),
            passes.CompactBufferAllocation(),
            passes.LowerOpaqueBlock(),
            tvm.tirx.transform.FlattenBuffer(),
        ]
    )
    script = lower(tvm.IRModule({"main": func}))["main"].script()
    shapes = re.findall(r"T\.alloc_buffer\(\(([^)]*)\)", script)
    assert len(shapes) >= 9 * 4
    for shape in shapes:
        dims = [d.strip() for d in shape.split(",") if d.strip()]
        assert all(d.isdigit() for d in dims), shape
        assert np.prod([int(d) for d in dims]) <= 77, shape


def test_cpu_kernels_are_compacted_before_the_default_pipeline():
    """schedule_cpu marks its kernels; CompactKernels compacts their [rows] intermediates to
    constant shapes without TVM's symbolic proof (its Z3 prover took 2.8 s on a 43-block partial)
    and drops the mark; an unmarked function passes unchanged."""
    kernel = schedule_cpu(depth_attention_partial_func(3, 2, 64), host_target(2))
    plain = depth_attention_func(2, 64)
    assert tir_pipeline.MARK in kernel.attrs
    mod = tir_pipeline.CompactKernels()(tvm.IRModule({"kernel": kernel, "plain": plain}))
    assert tir_pipeline.MARK not in mod["kernel"].attrs
    shapes = [[d.strip() for d in shape.split(",") if d.strip()]
              for shape in re.findall(r"T\.sblock_alloc_buffer\(\(([^)]*)\)", mod["kernel"].script())]
    assert len(shapes) >= 3 * 3 and all(d.isdigit() for dims in shapes for d in dims), shapes
    tvm.ir.assert_structural_equal(mod["plain"], plain)


def test_long_partial_sums_block_by_block_in_one_loop():
    """From BLOCK_MAJOR blocks phase 1 adds block by block to all queries' running sums, under one
    loop over the features: compacted, each running sum is one vector per query (registers), not a
    [B, D] array per block; shorter partials keep a loop per query."""
    target = host_target(1)

    def running_sums(blocks):
        mod = tir_pipeline.CompactKernels()(tvm.IRModule({"k": schedule_cpu(depth_attention_partial_func(blocks, 3, 64),
                                                                             target)}))
        return re.findall(r"partial_sum_\d+ = T\.sblock_alloc_buffer\(\(([^)]*)\)", mod["k"].script())

    shapes, lanes = running_sums(BLOCK_MAJOR), vector_bits(target) // 32  # 8 (AVX2) or 16 (AVX-512)
    assert len(shapes) == BLOCK_MAJOR - 1 and set(shapes) == {f"1, 3, {lanes}"}, shapes
    assert running_sums(BLOCK_MAJOR - 1) == []


@pytest.mark.parametrize("make", [
    lambda: depth_attention_func(3, 64), lambda: depth_attention_backward_func(3, 64),
    lambda: depth_attention_partial_func(3, 2, 64), lambda: depth_attention_merge_func(2, 64, scale=5.0)],
    ids=["forward", "backward", "partial", "merge"])
def test_cpu_row_loop_is_parallel_only_on_more_than_one_core(make):
    """A kernel for one core keeps its row loop serial: a parallel loop enters TVM's thread pool on
    every call, even for one task (~10 us, 40-55 us after the worker slept)."""
    assert "T.parallel" in schedule_cpu(make(), host_target(2)).script()
    assert "T.parallel" not in schedule_cpu(make(), host_target(1)).script()


def test_one_core_kernels_match_reference():
    """The serial (one-core) forward and backward against float64, as the parallel ones above."""
    rng = np.random.default_rng(5)
    sources, w, g = _sources(rng, 4, 130, 77, "float32"), _query(rng, 77), rng.standard_normal((130, 77))
    forward = build(depth_attention_func(4, 77, scale=4.0), host_target(1))
    _assert_close(_run(forward, *sources, w, np.empty_like(sources[0]))[-1].numpy(),
                  reference(sources, w, 1e-6, 4.0), "float32")
    backward = build(depth_attention_backward_func(4, 77, scale=4.0), host_target(1))
    out = _run(backward, *sources, w, g.astype(np.float32), *[np.empty_like(s) for s in sources],
               np.empty(77, np.float32))
    ds, dw = backward_reference(sources, w, g, 1e-6, 4.0)
    for got, ref in zip(out[6:10], ds):
        _assert_close(got.numpy(), ref, "float32")
    _assert_close(out[-1].numpy(), dw, "float32")


def test_cpu_row_reductions_keep_eight_partial_sums_in_the_forward_family():
    """On a 16-lane (AVX-512) target the forward, partial and merge reduce each row over 8 partial
    sums (their scalar sums dominated a 42-block partial at 16); the backward keeps 16."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})

    def lanes(func) -> set[int]:
        return {int(b.shape[0]) for b in schedule_cpu(func, target).body.block.alloc_buffers
                if b.name.endswith(".rf") and not b.name.startswith("dw")}

    assert lanes(depth_attention_func(3, 256)) == {8}
    assert lanes(depth_attention_partial_func(3, 2, 256)) == {8}
    assert lanes(depth_attention_merge_func(2, 96, scale=5.0)) == {8}
    assert lanes(depth_attention_backward_func(3, 256)) == {16}
    assert lanes(depth_attention_func(3, 100)) == {5}  # the largest divisor of D up to 8


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cuda_builds_and_compiles_with_nvcc(dtype):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: cannot compile the generated CUDA source")
    from tvm.support import nvcc

    target = tvm.target.Target(CUDA)
    funcs = [depth_attention_func(9, 1024, dtype), depth_attention_func(3, 77, dtype, rank=3),
             depth_attention_backward_func(3, 77, dtype, rank=3),
             depth_attention_backward_func(3, 77, dtype, rank=3, chunk=True)]
    if dtype == "float32":
        funcs += [depth_attention_norm_func(3, 1024, dtype, norm="layer"),  # the fused site + norm pair
                  depth_attention_norm_backward_func(3, 77, dtype, rank=3, norm="rms", grad_mixed=False),
                  depth_attention_partial_func(3, 2, 1024, dtype), depth_attention_merge_func(2, 1024, dtype),
                  depth_attention_partial_func(BLOCK_MAJOR, 3, 77, dtype, rank=3),
                  depth_attention_partial_func(BLOCK_MAJOR, 3, 77, dtype, rank=3, start=True)]  # a chain's link
    for func in funcs:
        module = build(func, target)
        (device,) = [m for m in module.mod.imports if m.kind == "cuda"]
        source = device.inspect_source()
        assert "__global__" in source and "__shfl_down_sync" in source
        with target:
            fatbin = nvcc.compile_cuda(source, target_format="fatbin", compiler="nvcc")
        assert len(fatbin) > 0


def test_rejects_bad_arguments():
    with pytest.raises(ValueError):
        depth_attention_func(0, 64)
    with pytest.raises(ValueError):
        depth_attention_func(2, 64, "int8")
    with pytest.raises(ValueError):
        depth_attention_partial_func(2, 0, 64)
    with pytest.raises(ValueError, match="rank >= 2"):
        depth_attention_backward_func(2, 64, rank=1)
