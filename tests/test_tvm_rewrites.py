"""Relax rewrites of the TVM pipeline (backends/tvm/rewrites.py): structure, then numbers."""

import numpy as np
import pytest
import tvm
from tvm import relax

from attnres_compile.backends.tvm.rewrites import WrapTakeIndices


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
