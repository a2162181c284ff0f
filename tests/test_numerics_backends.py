"""Numerics of the two non-PyTorch implementations of a depth-attention site at the edges:

  - "onnx": the ONNX site, one `attnres.DepthAttention` node (`onnx_function.site_node`) with its
    model-local function body (`onnx_function.function_proto`), run by onnxruntime (CPU), on a
    `[.., D]` stream (axis -1) and an NCHW stream (axis 1, written -3);
  - "tvm": the fused TVM kernel `depth_attention_func` built for llvm (`host_target`), on
    `[rows, D]` sources.

Cases (the same as tests/test_numerics.py covers for the PyTorch op): fp16 and fp32 sources at
large (1e4) and tiny (1e-6) magnitudes, paper (c = 1) and preserve (c = n) scale; all-zero
sources; a single source; identical sources; a feature size of 1. Every output must be finite
and match a float64 reference written from the formula (DESIGN.md §2)

    out = c * sum_i softmax_i(w . s_i / sqrt(mean(s_i^2) + eps)) * s_i     (over the feature axis)

computed from the sources as stored (fp16 values are exact in float64), so the comparison
measures only the backend's own float32 arithmetic and the final rounding to the storage dtype.

Tolerances, per element, |out - ref| <= atol + rtol * |ref| (the scheme of tests/test_numerics.py):
  - rtol = eps(fp16) = 2^-10 for fp16 storage: the final cast rounds to nearest, at most half an
    ulp (eps/2 relative for a normal result); eps leaves a factor 2. For fp32 storage 1e-6:
    the last float32 rounding is 2^-24 = 6e-8 relative, and ORT / LLVM may fuse or reorder the
    final multiply, a few ulp at most.
  - atol = COMPUTE * c * max|s| + subnormal spacing. COMPUTE bounds the float32 work relative to
    the output's scale: a logit is a D-term dot product (D <= 16, unit-scale w) with relative
    error ~D * 2^-24 ~ 1e-6, which perturbs each softmax weight by about that much relative;
    summing n <= 6 weighted sources adds ~n * 2^-24; the TVM kernel's online softmax rescales
    the running sum once per source (another ~n * 2^-24). Together < 3e-6; COMPUTE = 1e-5 leaves
    a factor 3. The subnormal spacing (finfo(fp16).tiny * eps = 6e-8) covers results that are
    subnormal in fp16 (1e-6 is: only ~6% relative precision there, so rtol alone is too tight).
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from attnres_compile.onnx import function as onnx_function

tvm = pytest.importorskip("tvm")
from attnres_compile.backends.tvm import build, depth_attention_func, host_target  # noqa: E402

EPS = 1e-6
COMPUTE = 1e-5
OPSET = 17
DTYPES = [np.float16, np.float32]
ONNX_TYPES = {np.float16: TensorProto.FLOAT16, np.float32: TensorProto.FLOAT}
# (shape, feature axis): ONNX on a [B, T, D] stream and an NCHW stream; TVM takes [rows, D]
ONNX_SHAPES = {"seq": ((3, 5, 16), -1), "nchw": ((2, 16, 3, 3), 1)}
TVM_SHAPE = ((15, 16), -1)


# ----------------------------------------------------------------------------- reference

def reference(sources, w, eps, scale, axis):
    v = [np.moveaxis(s.astype(np.float64), axis, -1) for s in sources]
    w = w.astype(np.float64)
    z = np.stack([(x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w).sum(-1) for x in v])
    p = np.exp(z - z.max(0))
    p /= p.sum(0)
    out = scale * sum(p[i][..., None] * x for i, x in enumerate(v))
    return np.moveaxis(out, -1, axis)


def tolerances(dtype, scale, sources):
    magnitude = max(float(np.abs(s.astype(np.float64)).max()) for s in sources)
    if dtype == np.float32:
        return COMPUTE * scale * magnitude, 1e-6
    fi = np.finfo(np.float16)
    return COMPUTE * scale * magnitude + float(fi.tiny) * float(fi.eps), float(fi.eps)


def check(out, sources, w, scale, axis):
    assert out.dtype == sources[0].dtype and out.shape == sources[0].shape
    assert np.isfinite(out).all(), "NaN or Inf in the output"
    ref = reference(sources, w, EPS, scale, axis)
    atol, rtol = tolerances(sources[0].dtype, scale, sources)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=atol, rtol=rtol)
    return ref


def make_sources(n, shape, magnitude, dtype, seed):
    """n sources uniform in [-magnitude, magnitude] (no fp16 overflow from a tail value), each
    scaled by its own factor in [0.5, 1] so they differ in RMS as well as in direction."""
    rng = np.random.default_rng(seed)
    return [((rng.random(shape) * 2 - 1) * magnitude * (0.5 + 0.5 * rng.random())).astype(dtype) for _ in range(n)]


def make_query(size, seed=7):
    return np.random.default_rng(seed).standard_normal(size).astype(np.float32)


# ----------------------------------------------------------------------------- backends

@functools.cache
def _onnx_session(n, shape, axis, dtype, scale):
    rank = len(shape)
    names = [f"s{i}" for i in range(n)]
    node = onnx_function.site_node(names, "q", "y", eps=EPS, scale=scale, axis=axis, rank=rank, name="site")
    sig = onnx_function.signature(node)
    node.overload = onnx_function.overload(sig)
    elem = ONNX_TYPES[dtype]
    graph = helper.make_graph(
        [node], "site",
        [helper.make_tensor_value_info(s, elem, list(shape)) for s in names]
        + [helper.make_tensor_value_info("q", TensorProto.FLOAT, [shape[axis]])],
        [helper.make_tensor_value_info("y", elem, list(shape))],
    )
    model = helper.make_model(
        graph, functions=[onnx_function.function_proto(sig, OPSET)],
        opset_imports=[helper.make_opsetid("", OPSET),
                       helper.make_opsetid(onnx_function.DOMAIN, onnx_function.DOMAIN_VERSION)],
    )
    model.ir_version = onnx_function.IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def run_onnx(sources, w, scale, axis):
    s0 = sources[0]
    sess = _onnx_session(len(sources), s0.shape, axis, s0.dtype.type, float(scale))
    feeds = {f"s{i}": s for i, s in enumerate(sources)}
    feeds["q"] = w
    (out,) = sess.run(None, feeds)
    return out


@functools.cache
def _tvm_module(n, size, dtype, scale):
    return build(depth_attention_func(n, size, dtype, EPS, scale), host_target(2))


def run_tvm(sources, w, scale, axis):
    assert axis in (-1, sources[0].ndim - 1) and sources[0].ndim == 2
    s0 = sources[0]
    module = _tvm_module(len(sources), s0.shape[-1], np.dtype(s0.dtype).name, float(scale))
    out = np.zeros_like(s0)
    tensors = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in [*sources, w, out]]
    module(*tensors)
    return tensors[-1].numpy()


BACKENDS = {"onnx": run_onnx, "tvm": run_tvm}
# (backend, shape id): every ONNX layout, TVM on its 2-D layout
LAYOUTS = [("onnx", *ONNX_SHAPES["seq"]), ("onnx", *ONNX_SHAPES["nchw"]), ("tvm", *TVM_SHAPE)]
LAYOUT_IDS = ["onnx-seq", "onnx-nchw", "tvm"]


# ----------------------------------------------------------------------------- cases

@pytest.mark.parametrize("backend,shape,axis", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("magnitude", [1e4, 1e-6])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "fp32"])
@pytest.mark.parametrize("paper", [True, False], ids=["paper", "preserve"])
def test_extreme_magnitudes(backend, shape, axis, magnitude, dtype, paper):
    """n = 4 sources, |s| <= 1e4: |out| <= c * 1e4 = 4e4 < 65504, representable in fp16, so it must
    be finite and right (sum(s^2) = D * 1e8 would overflow fp16: the compute must be float32).
    At 1e-6 the RMS is below sqrt(eps) = 1e-3: keys ~ s / 1e-3, weights nearly uniform, the
    output ~ c * mean(s), subnormal in fp16."""
    n = 4
    sources = make_sources(n, shape, magnitude, dtype, seed=int(magnitude > 1) + 2 * len(shape))
    w = make_query(shape[axis])
    scale = 1.0 if paper else float(n)
    check(BACKENDS[backend](sources, w, scale, axis), sources, w, scale, axis)


@pytest.mark.parametrize("backend,shape,axis", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "fp32"])
@pytest.mark.parametrize("n", [1, 3])
def test_all_zero_sources(backend, shape, axis, dtype, n):
    """RMSNorm(0) = 0 / sqrt(eps) = 0: logits 0, uniform weights, output exactly 0 (no 0/0)."""
    sources = [np.zeros(shape, dtype) for _ in range(n)]
    w = make_query(shape[axis])
    out = BACKENDS[backend](sources, w, float(n), axis)
    assert out.dtype == dtype and np.isfinite(out).all()
    assert not np.any(out), "all-zero sources must give an all-zero output"


@pytest.mark.parametrize("backend,shape,axis", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "fp32"])
@pytest.mark.parametrize("magnitude", [1.0, 1e4, 1e-6])
def test_single_source(backend, shape, axis, dtype, magnitude):
    """One source: its softmax weight is exp(0) / exp(0) = 1 exactly, so out = c * s with one
    float32 rounding then the storage cast; with c = 1 the output is s itself, bit for bit."""
    (s,) = make_sources(1, shape, magnitude, dtype, seed=5)
    w = make_query(shape[axis]) * 10
    run = BACKENDS[backend]
    np.testing.assert_array_equal(run([s], w, 1.0, axis), s)
    c = 1.0 if dtype == np.float16 and magnitude > 1 else 2.5
    # the backend computes c * float32(s) then casts: at most half an ulp of the storage dtype
    # from the exact c * s (fp32: one rounding; the float32 product is exact before the cast)
    check(run([s], w, c, axis), [s], w, c, axis)


@pytest.mark.parametrize("backend,shape,axis", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "fp32"])
@pytest.mark.parametrize("magnitude", [1.0, 1e4, 1e-6])
def test_identical_sources(backend, shape, axis, dtype, magnitude):
    """n = 3 copies of s: equal logits, weights 1/n whatever w, so out = c * s. float32 rounds 1/n
    and the n-term sum (<= 2n ulp relative): rtol 4n * 2^-24 for fp32 (factor 2), eps for fp16."""
    n = 3
    (s,) = make_sources(1, shape, magnitude, dtype, seed=n)
    w = make_query(shape[axis]) * 3
    for c in (1.0, float(n)):
        out = BACKENDS[backend]([s] * n, w, c, axis)
        assert np.isfinite(out).all()
        fi = np.finfo(dtype)
        rtol = 4 * n * 2.0**-24 if dtype == np.float32 else float(fi.eps)
        np.testing.assert_allclose(out.astype(np.float64), c * s.astype(np.float64),
                                   atol=float(fi.tiny) * float(fi.eps), rtol=rtol)
        check(out, [s] * n, w, c, axis)


D1_LAYOUTS = [("onnx", (4, 7, 1), -1), ("onnx", (2, 1, 3, 3), 1), ("tvm", (28, 1), -1)]


@pytest.mark.parametrize("backend,shape,axis", D1_LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "fp32"])
def test_feature_size_one(backend, shape, axis, dtype):
    """D = 1: the key s / sqrt(s^2 + eps) is ~sign(s), the logit ~ +-w; one of the 6 sources is
    zero (key 0). Two queries: a mild one and a peaked one (|w| = 30: weights ~ e^60 apart,
    exercising the max subtraction)."""
    sources = make_sources(5, shape, 1.0, dtype, seed=11) + [np.zeros(shape, dtype)]
    for w in (np.array([0.7], np.float32), np.array([-30.0], np.float32)):
        check(BACKENDS[backend](sources, w, 6.0, axis), sources, w, 6.0, axis)
