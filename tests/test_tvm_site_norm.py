"""The next norm fused into a site kernel (backends/tvm/site_norm.py): which Relax patterns
match, which must not, and the lowered module's numbers against the unfused one."""

import numpy as np
import pytest
import tvm
from tvm import relax

from attnres_compile.backends.tvm import LowerDepthAttention
from attnres_compile.backends.tvm.lower import KERNEL_PREFIX, calls
from attnres_compile.backends.tvm.site_norm import Plan
from attnres_compile.backends.tvm.pipeline import finish, make_target, prepare, schedule
from attnres_compile.backends.tvm.sites import site_call

D, EPS = 16, 1e-5


def _rms(bb, x, gamma, form: str):
    """RMSNorm as exporters write it: the ONNX form (1 / sqrt) or torch.export's (rsqrt)."""
    square = bb.emit(relax.op.power(x, relax.const(2.0, "float32")) if form != "square"
                     else relax.op.multiply(x, x))
    mean = bb.emit(relax.op.mean(square, axis=[-1], keepdims=True))
    shifted = bb.emit(relax.op.add(mean, relax.const(EPS, "float32")))
    if form == "sqrt":
        rinv = bb.emit(relax.op.divide(relax.const(1.0, "float32"), bb.emit(relax.op.sqrt(shifted))))
    else:
        rinv = bb.emit(relax.op.rsqrt(shifted))
    return bb.emit(relax.op.multiply(gamma, bb.emit(relax.op.multiply(x, rinv))))


def _module(norm: str, form: str = "sqrt", extra_reader: bool = False, late_gamma: int = 0,
            view: tuple | None = None) -> tvm.IRModule:
    """main(s0, s1, w, gamma, beta) = norm(site(s0, s1)) [+ the site's value, read a second time]
    [with gamma + 1 as the norm's gain, computed after the site, as Gemma's norm does in a .pt2;
    late_gamma=2: then times 2, a second step]
    [of the site's value reshaped to `view` first, as HF OPT views its stream as [batch * seq, D]]."""
    bb = relax.BlockBuilder()
    s0, s1 = (relax.Var(f"s{i}", relax.TensorType((2, 5, D), "float32")) for i in range(2))
    w = relax.Var("w", relax.TensorType((D,), "float32"))
    gamma, beta = (relax.Var(n, relax.TensorType((D if view is None else view[-1],), "float32")) for n in ("gamma", "beta"))
    with bb.function("main", [s0, s1, w, gamma, beta]):
        with bb.dataflow():
            x = bb.emit(site_call([s0, s1], w, 1e-6, 2.0, -1))
            if view is not None:
                x = bb.emit(relax.op.reshape(x, view))
            if late_gamma:
                gamma = bb.emit(relax.op.add(gamma, relax.const(1.0, "float32")))
            if late_gamma > 1:
                gamma = bb.emit(relax.op.multiply(gamma, relax.const(2.0, "float32")))
            if norm == "layer":
                y = bb.emit(relax.op.nn.layer_norm(x, gamma, beta, axes=[-1], epsilon=EPS))
            else:
                y = _rms(bb, x, gamma, form)
            if extra_reader:
                y = bb.emit(relax.op.add(y, x))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("norm, form", [("layer", ""), ("rms", "sqrt"), ("rms", "rsqrt"), ("rms", "square")])
def test_a_norm_read_only_by_its_site_is_planned(norm, form):
    plan = Plan()
    plan.add(_module(norm, form)["main"])
    (fused,) = plan.norms.values()
    assert (fused.kind, fused.eps) == (norm, pytest.approx(EPS))
    assert (fused.beta is None) == (norm == "rms")
    assert len(plan.replaced) == 1
    # the RMSNorm's steps before its last multiply: square, mean, add, [sqrt,] 1/x, x * r
    assert len(plan.dropped) == {"layer": 0, "sqrt": 6, "rsqrt": 5, "square": 5}[form or "layer"]


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_a_norm_of_a_row_view_of_the_site_is_planned(norm):
    """Between site and norm, a reshape that keeps the feature size (OPT's [batch * seq, D]): the
    norm's value is replaced by that reshape, which stays and now reshapes the normed rows."""
    main = _module(norm, "sqrt", view=(10, D))["main"]
    plan = Plan()
    plan.add(main)
    assert len(plan.norms) == 1
    (view,) = plan.replaced.values()
    reshapes = [b.var for b in main.body.blocks[0].bindings if getattr(b.value, "op", None) == tvm.ir.Op.get("relax.reshape")]
    assert [view] == reshapes


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_a_gain_computed_after_the_site_is_computed_before_it(norm):
    """Gemma's `1 + weight`, bound at the norm (a .pt2): the plan keeps that call as the gain, for the
    lowering to emit before the kernel."""
    plan = Plan()
    plan.add(_module(norm, "sqrt", late_gamma=1)["main"])
    (fused,) = plan.norms.values()
    assert isinstance(fused.gamma, relax.Call) and fused.gamma.op.name == "relax.add"


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("case", ["site value read elsewhere too", "gain computed after the site in two steps",
                                  "reshape that regroups the features"])
def test_not_fused(norm, case):
    plan = Plan()
    plan.add(_module(norm, "sqrt", extra_reader=case.startswith("site"), late_gamma=2 * case.startswith("gain"),
                     view=(5, 2 * D) if case.startswith("reshape") else None)["main"])
    assert plan.norms == {} and plan.dropped == set()


@pytest.mark.parametrize("norm, form, view, late_gamma", [
    ("layer", "", None, 0), ("rms", "sqrt", None, 0), ("rms", "rsqrt", None, 0),
    ("layer", "", (10, D), 0), ("rms", "sqrt", (10, D), 0), ("layer", "", None, 1), ("rms", "rsqrt", None, 1)])
def test_lowered_with_the_norm_fused_matches_float64(norm, form, view, late_gamma):
    """The CPU lowering gives the site an `_ln` / `_rms` kernel and leaves none of the norm's ops;
    the compiled module matches the site and the norm in float64 (numpy), also where the norm
    reads the site's rows through a reshape and where its gain is computed after the site."""
    lowered = LowerDepthAttention(make_target("llvm"))(_module(norm, form, view=view, late_gamma=late_gamma))
    counted = calls(lowered)
    suffix = "_ln" if norm == "layer" else "_rms"
    assert sum(v for k, v in counted.items() if k.startswith(KERNEL_PREFIX) and k.endswith(suffix)) == 1
    assert not {"relax.nn.layer_norm", "relax.mean", "relax.power", "relax.multiply", "relax.sqrt"} & set(counted)
    target = make_target("llvm")
    exe = tvm.compile(schedule(prepare(lowered, target), target), target, relax_pipeline=finish(target))
    rng = np.random.default_rng(0)
    s0, s1 = (rng.standard_normal((2, 5, D)).astype("float32") + 2 for _ in range(2))
    w, gamma, beta = (rng.standard_normal(D).astype("float32") for _ in range(3))
    got = relax.VirtualMachine(exe, tvm.cpu())["main"](*map(tvm.runtime.tensor, (s0, s1, w, gamma, beta))).numpy()
    v = np.stack([s0, s1]).astype(np.float64)
    z = np.einsum("d,s...d->s...", w, v) / np.sqrt((v**2).mean(-1) + 1e-6)
    p = np.exp(z - z.max(0))
    x = 2.0 * np.einsum("s...,s...d->...d", p / p.sum(0), v)
    gain = gamma + late_gamma  # late_gamma 1: gamma + 1
    if norm == "layer":
        expected = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + EPS) * gain + beta
    else:
        expected = x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * gain
    expected = expected if view is None else expected.reshape(view)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
