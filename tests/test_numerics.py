"""Numerics of `torch.ops.attnres.depth_attention` at the edges: low-precision storage at large
and tiny magnitudes, all-zero / single / identical sources, a feature size of 1, peaked logits.

Every case runs both implementations of the op (the fused TVM kernels, the eager reference) and
is compared with a float64 reference written from DESIGN.md §2:

    out = scale * sum_i softmax_i(w . s_i / sqrt(mean(s_i^2) + eps)) * s_i     (over axis `dim`)

computed from the sources exactly as stored (fp16/bf16 values are exact in float64), so the
comparison measures only the op's own arithmetic: float32 compute (DESIGN.md: softmax and
accumulation in float32 whatever the storage dtype) and the final rounding to the storage dtype.

Tolerances, per element, |out - ref| <= atol + rtol * |ref|:
  - rtol = eps(storage dtype) for fp16/bf16: the final cast rounds to nearest, at most half an
    ulp, i.e. eps/2 relative for a normal result; eps leaves a factor 2.
  - atol = COMPUTE * scale * max|s| + subnormal spacing. COMPUTE bounds the float32 work
    relative to the output's scale: the logits carry a relative error of ~D * 2^-24 (a dot
    product of D terms; D <= 16 here, unit-scale w), which perturbs each softmax weight by about
    that much relative, and accumulating n <= 8 weighted sources adds ~n * 2^-24 more, both
    times scale * max|s|: together < 2e-6 relative; COMPUTE = 1e-5 leaves a factor 5. The
    subnormal spacing (finfo.tiny * finfo.eps: 6e-8 for fp16) covers the cast of results that
    are subnormal in the storage dtype (1e-6 is subnormal in fp16: its relative precision there
    is only ~6%, so rtol alone would be too tight).
"""

import pytest
import torch

op = torch.ops.attnres.depth_attention.default


@pytest.fixture(autouse=True)
def both_kernels(kernel):
    """Every case against both implementations: the fused TVM kernels and the eager reference."""
    return kernel


LOW = [torch.float16, torch.bfloat16]
COMPUTE = 1e-5
FP16_MAX = torch.finfo(torch.float16).max  # 65504; values >= 65520 round to inf
SHAPES = [((3, 5, 16), -1), ((2, 8, 3, 3), 1)]  # a [.., D] stream and an NCHW stream (feature axis 1)


def reference(sources, w, eps, scale, dim):
    """float64 reference, straight from DESIGN.md §2 (no stacking tricks shared with the op)."""
    v = [s.double().movedim(dim, -1) for s in sources]
    z = torch.stack([(x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()).sum(-1) for x in v])
    p = torch.softmax(z, 0)  # float64: exact enough to be the reference
    out = scale * sum(p[i].unsqueeze(-1) * x for i, x in enumerate(v))
    return out.movedim(-1, dim)


def tolerances(dtype, scale, sources):
    magnitude = max(s.double().abs().max().item() for s in sources)
    if dtype == torch.float32:
        # no storage rounding beyond float32 itself: 1e-6 relative for the final float32 rounding
        return COMPUTE * scale * magnitude, 1e-6
    fi = torch.finfo(dtype)
    return COMPUTE * scale * magnitude + fi.tiny * fi.eps, fi.eps


def check(sources, w, eps, scale, dim):
    out = op(sources, w, eps, scale, dim)
    assert out.dtype == sources[0].dtype and out.shape == sources[0].shape
    assert torch.isfinite(out).all(), "NaN or Inf in the output"
    ref = reference(sources, w, eps, scale, dim)
    atol, rtol = tolerances(sources[0].dtype, scale, sources)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    return out, ref


def make_sources(n, shape, magnitude, dtype, seed):
    """n sources with entries in [-magnitude, magnitude] (uniform: no fp16 overflow from a tail
    value), each scaled by its own factor in [0.5, 1] so they differ in RMS as well as direction."""
    g = torch.Generator().manual_seed(seed)
    return [((torch.rand(shape, generator=g) * 2 - 1) * magnitude * (0.5 + 0.5 * torch.rand(1, generator=g))).to(dtype)
            for _ in range(n)]


@pytest.mark.parametrize("shape,dim", SHAPES)
@pytest.mark.parametrize("magnitude", [1e4, 1e-6])
@pytest.mark.parametrize("dtype", LOW + [torch.float32])
@pytest.mark.parametrize("paper", [True, False], ids=["paper", "preserve"])
def test_extreme_magnitudes(dtype, magnitude, shape, dim, paper):
    """Large (1e4) and tiny (1e-6) sources in fp16, bf16 and fp32, paper (c = 1) and preserve
    (c = n) scale. With n = 4 sources of |s| <= 1e4, |out| <= n * 1e4 = 4e4 < 65504: the true
    output is representable in fp16, so it must come out finite and right (an intermediate
    like sum(s^2) = D * 1e8 would overflow fp16, hence float32 compute). At 1e-6 the RMS is
    below sqrt(eps) = 1e-3, so the keys are ~s/1e-3 and the weights nearly uniform: the output
    is ~c * mean(s), subnormal in fp16."""
    n = 4
    sources = make_sources(n, shape, magnitude, dtype, seed=int(magnitude > 1) + 2 * dim)
    w = torch.randn(shape[dim], generator=torch.Generator().manual_seed(7))
    check(sources, w, 1e-6, 1.0 if paper else float(n), dim)


@pytest.mark.parametrize("shape,dim", SHAPES)
def test_fp16_output_overflow_is_inf_not_nan(shape, dim):
    """Preserve scale over n = 3 identical fp16 sources is 3 * s, whatever w. Where |3 s| > 65520
    the exact result is not representable in fp16 and the correct rounding is +-inf, with the
    sign of s (the original model's plain fp16 sum h = s + s + s overflows the same way); where it
    fits it must be exact to the cast. Never NaN. In float32 storage the same op is finite:
    the overflow is the output cast only, not the float32 accumulation."""
    g = torch.Generator().manual_seed(3)
    big = torch.rand(shape, generator=g) < 0.5
    mag = torch.where(big, 2.5e4 + 5e3 * torch.rand(shape, generator=g), 1e4 * torch.rand(shape, generator=g))
    s = (mag * torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)).half()
    w = torch.randn(shape[dim], generator=g)
    out = op([s, s, s], w, 1e-6, 3.0, dim)
    ref = 3 * s.double()
    assert not torch.isnan(out).any()
    overflow = ref.abs() > 65520
    assert torch.equal(torch.isinf(out), overflow) and overflow.any() and (~overflow).any()
    assert torch.equal(torch.sign(out[overflow].double()), torch.sign(ref[overflow]))
    fi = torch.finfo(torch.float16)
    torch.testing.assert_close(out[~overflow].double(), ref[~overflow], atol=COMPUTE * 3 * 3e4, rtol=fi.eps)
    out32 = op([s.float()] * 3, w, 1e-6, 3.0, dim)
    assert torch.isfinite(out32).all()
    torch.testing.assert_close(out32.double(), ref, atol=COMPUTE * 3 * 3e4, rtol=1e-6)
    # paper scale (c = 1) over the same sources is s itself: representable, hence finite
    assert torch.isfinite(op([s, s, s], w, 1e-6, 1.0, dim)).all()


@pytest.mark.parametrize("dtype", LOW + [torch.float32])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("shape,dim", SHAPES)
def test_all_zero_sources(dtype, n, shape, dim):
    """RMSNorm(0) = 0 / sqrt(eps) = 0 (legal, DESIGN.md §2): logits 0, uniform weights, output
    exactly 0 and finite gradients (fp32: the backward divides by sqrt(mean(s^2) + eps) only)."""
    sources = [torch.zeros(shape, dtype=dtype) for _ in range(n)]
    w = torch.randn(shape[dim])
    out = op(sources, w, 1e-6, float(n), dim)
    assert torch.equal(out, torch.zeros_like(out))
    if dtype == torch.float32:
        leaves = [s.clone().requires_grad_() for s in sources]
        wq = w.clone().requires_grad_()
        op(leaves, wq, 1e-6, float(n), dim).sum().backward()
        assert all(torch.isfinite(x.grad).all() for x in leaves + [wq])


@pytest.mark.parametrize("dtype", LOW + [torch.float32])
@pytest.mark.parametrize("magnitude", [1.0, 1e4, 1e-6])
@pytest.mark.parametrize("shape,dim", SHAPES)
def test_single_source(dtype, magnitude, shape, dim):
    """One source: its softmax weight is exactly 1 (exp(0) / exp(0)), so out = c * s with a single
    float32 rounding then the storage cast, bit for bit; with c = 1 the output is s itself."""
    (s,) = make_sources(1, shape, magnitude, dtype, seed=5)
    w = torch.randn(shape[dim]) * 10
    assert torch.equal(op([s], w, 1e-6, 1.0, dim), s)
    c = 1.0 if dtype == torch.float16 and magnitude > 1 else 2.5  # 2.5e4 would still fit; keep it simple
    assert torch.equal(op([s], w, 1e-6, c, dim), (s.float() * c).to(dtype))
    check([s], w, 1e-6, c, dim)


@pytest.mark.parametrize("dtype", LOW + [torch.float32])
@pytest.mark.parametrize("magnitude", [1.0, 1e4, 1e-6])
@pytest.mark.parametrize("n", [2, 5])
def test_identical_sources(dtype, magnitude, n):
    """n copies of s: equal logits, weights 1/n whatever w, so out = c * s. fp32 compute rounds
    1/n and the n-term sum: <= 2n ulp relative; 4n * 2^-24 leaves a factor 2 (fp32 storage).
    fp16 with preserve scale at 1e4 would reach n * 1e4 (5e4 for n = 5): still representable."""
    (s,) = make_sources(1, (4, 6, 8), magnitude, dtype, seed=n)
    w = torch.randn(8) * 3
    for c in (1.0, float(n)):
        out = op([s] * n, w, 1e-6, c, -1)
        assert torch.isfinite(out).all()
        rtol = 4 * n * 2**-24 if dtype == torch.float32 else torch.finfo(dtype).eps
        fi = torch.finfo(dtype)
        torch.testing.assert_close(out.double(), c * s.double(), atol=fi.tiny * fi.eps, rtol=rtol)
        check([s] * n, w, 1e-6, c, -1)


@pytest.mark.parametrize("dtype", LOW + [torch.float32])
@pytest.mark.parametrize("shape,dim", [((4, 7, 1), -1), ((2, 1, 3, 3), 1)])
def test_feature_size_one(dtype, shape, dim):
    """D = 1: the key s / sqrt(s^2 + eps) is ~sign(s), the logit ~ +-w; one source is zero."""
    sources = make_sources(5, shape, 1.0, dtype, seed=11) + [torch.zeros(shape, dtype=dtype)]
    for w in (torch.tensor([0.7]), torch.tensor([-30.0])):
        check(sources, w, 1e-6, 6.0, dim)


@pytest.mark.parametrize("dtype", LOW + [torch.float32])
def test_peaked_logits_do_not_overflow(dtype):
    """|w| ~ 100 over D = 16 gives logits of several hundred: exp overflows float32 above 88 unless
    the max is subtracted (DESIGN.md §2). The logit error is then ~D * 2^-24 * |z| ~ 5e-4
    absolute, which moves a weight by up to that much relative: atol 1e-3 * c * max|s|."""
    sources = make_sources(6, (3, 5, 16), 1.0, dtype, seed=13)
    w = torch.randn(16, generator=torch.Generator().manual_seed(1)) * 100
    out = op(sources, w, 1e-6, 6.0, -1)
    assert torch.isfinite(out).all()
    ref = reference(sources, w, 1e-6, 6.0, -1)
    rtol = 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
    torch.testing.assert_close(out.double(), ref, atol=1e-3 * 6.0, rtol=rtol)
