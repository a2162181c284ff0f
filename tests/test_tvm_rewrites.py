"""Relax rewrites of the TVM pipeline (backends/tvm/rewrites.py): structure, then numbers."""

import numpy as np
import pytest
import tvm
from tvm import relax

from attnres_compile.backends.tvm.rewrites import KeysInPlace, WrapTakeIndices


def _take_module(mode: str) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    table = relax.Var("table", relax.TensorType((5, 3), "float32"))
    ids = relax.Var("ids", relax.TensorType((4,), "int64"))
    with bb.function("main", [table, ids]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.take(table, ids, axis=0, mode=mode))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("mode", ["fast", "clip"])
def test_take_wraps_where_the_frontend_asked_for_fast(mode):
    after = WrapTakeIndices()(_take_module(mode))
    tvm.ir.assert_structural_equal(after, _take_module("wrap" if mode == "fast" else mode))


def test_wrapped_take_matches_torch_in_range_and_stays_in_bounds_past_it():
    """In range (negative ones count from the end, as torch's and ONNX's Gather do) the rows
    are the table's; past the table they are rows of the table, where fast mode reads memory
    outside it."""
    with tvm.target.Target("llvm"):
        mod = relax.transform.LegalizeOps()(WrapTakeIndices()(_take_module("fast")))
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    table = np.arange(15, dtype="float32").reshape(5, 3)
    for ids in ([0, 4, -1, -5], [5, 7, -6, 10**6]):
        got = vm["main"](tvm.runtime.tensor(table), tvm.runtime.tensor(np.array(ids, dtype="int64"))).numpy()
        np.testing.assert_array_equal(got, table[np.mod(ids, 5)])


def _scores_module(scale, grouped: bool = False, rows: int | None = None) -> tvm.IRModule:
    """q @ (K as ONNX's scaled dot-product attention transposes it: through a [batch * heads, T, D]
    view, its last two axes swapped, viewed back, times `scale`), batch, sequence and keys
    symbolic (the sequence `rows` where given); `grouped`: K has 2 heads, repeated to q's 4 first
    (HF's repeat_kv: expand, reshape)."""
    b, s, t = (tvm.tirx.Var(n, "int64") for n in ("b", "s", "t"))
    s = s if rows is None else rows
    q = relax.Var("q", relax.TensorType((b, 4, s, 8), "float32"))
    k = relax.Var("k", relax.TensorType((b, 2 if grouped else 4, t, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k]):
        with bb.dataflow():
            heads = k
            if grouped:
                wide = bb.emit(relax.op.broadcast_to(bb.emit(relax.op.expand_dims(k, 2)), (b, 2, 2, t, 8)))
                heads = bb.emit(relax.op.reshape(wide, (b, 4, t, 8)))
            flat = bb.emit(relax.op.reshape(heads, (4 * b, t, 8)))
            swapped = bb.emit(relax.op.permute_dims(flat, [0, 2, 1]))
            keys = bb.emit(relax.op.multiply(bb.emit(relax.op.reshape(swapped, (b, 4, 8, t))), scale))
            out = bb.emit_output(relax.op.matmul(q, keys))
        bb.emit_func_output(out)
    return bb.get()


def _ops(mod: tvm.IRModule) -> set[str]:
    names = set()
    relax.analysis.post_order_visit(mod["main"], lambda e: names.add(e.op.name) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) else None)
    return names


@pytest.mark.parametrize("grouped", [False, True])
def test_scores_read_the_keys_where_they_are_and_match(grouped):
    """The transposed, scaled copy of the keys is gone (one call_tir instead; grouped heads: their
    repeat too, the queries viewed per KV head), and the scores match numpy and the unrewritten
    build at two key lengths."""
    before = _scores_module(relax.const(0.35, "float32"), grouped)
    after = KeysInPlace()(before)
    assert {"relax.permute_dims", "relax.matmul", "relax.multiply"} <= _ops(before)
    views = {"relax.reshape"} if grouped else set()
    assert _ops(relax.transform.DeadCodeElimination()(after)) == {"relax.call_tir", *views}  # the copies are dead
    rng = np.random.default_rng(0)
    with tvm.target.Target("llvm"):
        vms = [relax.VirtualMachine(tvm.compile(relax.transform.LegalizeOps()(m), "llvm"), tvm.cpu())
               for m in (before, after)]
    for t in (1, 9):
        q = rng.standard_normal((2, 4, 3, 8)).astype("float32")
        k = rng.standard_normal((2, 2 if grouped else 4, t, 8)).astype("float32")
        got, unrewritten = (vm["main"](tvm.runtime.tensor(q), tvm.runtime.tensor(k)).numpy() for vm in reversed(vms))
        heads = np.repeat(k, 2, axis=1) if grouped else k
        np.testing.assert_allclose(got, q @ (heads.swapaxes(-1, -2) * np.float32(0.35)), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, unrewritten, rtol=1e-6, atol=1e-7)


def _values_module(heads: int = 2, axis: int = 2) -> tvm.IRModule:
    """p @ V with V's `heads` heads repeated to p's 4 as HF's repeat_kv does (expand_dims at `axis`,
    broadcast_to, reshape; axis 2: each head twice in a row), batch, sequence and keys symbolic."""
    b, s, t = (tvm.tirx.Var(n, "int64") for n in ("b", "s", "t"))
    p = relax.Var("p", relax.TensorType((b, 4, s, t), "float32"))
    v = relax.Var("v", relax.TensorType((b, heads, t, 8), "float32"))
    wide = [b, heads, t, 8]
    wide.insert(axis, 4 // heads)
    bb = relax.BlockBuilder()
    with bb.function("main", [p, v]):
        with bb.dataflow():
            repeated = bb.emit(relax.op.broadcast_to(bb.emit(relax.op.expand_dims(v, axis)), wide))
            out = bb.emit_output(relax.op.matmul(p, bb.emit(relax.op.reshape(repeated, (b, 4, t, 8)))))
        bb.emit_func_output(out)
    return bb.get()


def test_values_of_grouped_heads_are_read_where_they_are_and_match():
    """The repeat of V (a copy of the cache per call) is gone: p viewed as [b, 2, 2 * s, t] times V
    itself, viewed back; the product matches numpy and the unrewritten build at two key lengths."""
    before = _values_module()
    after = relax.transform.DeadCodeElimination()(KeysInPlace()(before))
    assert _ops(after) == {"relax.matmul", "relax.reshape"}
    rng = np.random.default_rng(0)
    with tvm.target.Target("llvm"):
        vms = [relax.VirtualMachine(tvm.compile(relax.transform.LegalizeOps()(m), "llvm"), tvm.cpu())
               for m in (before, after)]
    for t in (1, 9):
        p = rng.standard_normal((2, 4, 3, t)).astype("float32")
        v = rng.standard_normal((2, 2, t, 8)).astype("float32")
        got, unrewritten = (vm["main"](tvm.runtime.tensor(p), tvm.runtime.tensor(v)).numpy() for vm in reversed(vms))
        np.testing.assert_allclose(got, p @ np.repeat(v, 2, axis=1), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, unrewritten, rtol=1e-6, atol=1e-7)


def test_values_repeated_other_than_per_head_are_left_alone():
    """expand_dims before the heads axis tiles the heads (0, 1, 0, 1), which the view cannot express."""
    before = _values_module(axis=1)
    tvm.ir.assert_structural_equal(KeysInPlace()(before), before)


def test_a_prefills_scores_keep_their_gemm():
    """128 static query rows (a prefill built at static shapes) keep the transposed copy and the
    matmul, a GEMM; one static row (a decode step) reads the keys in place."""
    prefill = _scores_module(relax.const(0.35, "float32"), rows=128)
    tvm.ir.assert_structural_equal(KeysInPlace()(prefill), prefill)
    step = relax.transform.DeadCodeElimination()(KeysInPlace()(_scores_module(relax.const(0.35, "float32"), rows=1)))
    assert _ops(step) == {"relax.call_tir"}


def test_scores_scaled_by_a_vector_are_left_alone():
    before = _scores_module(relax.const(np.full((1,), 0.35, "float32").reshape(1, 1, 1, 1).repeat(8, 2)))
    tvm.ir.assert_structural_equal(KeysInPlace()(before), before)
