"""One product of a [1, 1, K] row by a constant [K, N] weight, built by the TVM pipeline with its rows static (1: the
row loop dropped, cpu_rules._one_row) and symbolic (the main library's 4-row tile with a per-row predicate);
1 thread, process CPU time, median of 7 x 20 calls; the weight's bytes over the time beside it.

    PYTHONPATH=$PWD python benchmarks/runs/2026-12-07-tvm-fixed-shapes/one_row_product.py K N
"""

import sys, time, numpy as np
from attnres_compile.bench.model.worker import set_threads
set_threads(1)
import tvm
from tvm import relax
from attnres_compile.backends.tvm import pipeline
from attnres_compile.backends.tvm.importers import ImportedModel
K, N = int(sys.argv[1]), int(sys.argv[2])
w = np.random.default_rng(0).standard_normal((K, N), dtype=np.float32)
res = {}
for kind in ("static", "symbolic"):
    bb = relax.BlockBuilder()
    rows = 1 if kind == "static" else tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((1, rows, K), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.const(w)))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    built = pipeline.build(ImportedModel(bb.get(), "onnx", ["x"], ["y"]), pipeline.make_target("llvm"))
    names = [gv.name_hint for gv in built.mod.functions]
    vm = relax.VirtualMachine(built.executable, tvm.cpu())
    xa = tvm.runtime.tensor(np.random.default_rng(1).standard_normal((1, 1, K), dtype=np.float32))
    err = float(np.abs(vm["main"](xa).numpy() - xa.numpy() @ w).max())
    ts = []
    for _ in range(7):
        t = time.process_time()
        for _ in range(20): vm["main"](xa)
        ts.append((time.process_time() - t) / 20)
    t = sorted(ts)[3]
    print(f"{kind} K{K} N{N}: {t*1e6:.0f} us, {K*N*4/t/1e9:.1f} GB/s, err {err:.1e}", [n for n in names if "matmul" in n])
