"""The attention scores `q @ K^T` of a grouped-query layer, alone, on each path the TVM pipeline can
give them: which is fastest for a prefill of 128 rows when the keys' length is symbolic (a
decoder-with-past library) and when it is static (a build at static shapes).

    PYTHONPATH=$PWD python benchmarks/runs/2026-12-06-tvm-prefill/scores_paths.py OUT.json

The Relax module is the scores as torch.onnx writes SDPA (tests/test_tvm_rewrites.py's form): HF's
repeat_kv of K (expand_dims, broadcast_to, reshape), a [b * h, T, d] view transposed, viewed back,
scaled by 1/8, then matmul. Geometries: SmolLM2-135M (9 query heads over 3 KV heads, d 64) and
`bench decode`'s Llama at widths 256 and 1024 (4 heads of 64 and of 256). Builds: pipeline.prepare
+ schedule + tvm.compile as compile_model does. Paths:
- `dot, symbolic`: batch, rows and keys symbolic: rewrites.KeysInPlace -> one `matmul_keys`
  operator of per-score dot products (cpu_rules.DotProducts): the decoder-with-past library today.
- `gemm, symbolic keys`: rows static (128: KeysInPlace keeps the copy), keys symbolic: the
  transposed copy and the GEMM rule over a symbolic column count.
- `gemm, static` / `dot, static`: rows and keys static 128 (`dot, static`: PREFILL_ROWS lifted so
  KeysInPlace rewrites it anyway).
Each timed at 1 thread, process CPU time, interleaved rounds (bench/timing.py), on a 128-row
prefill (past 0) and on a one-row step over 129 keys where its shapes allow; outputs compared.
"""

import json
import os
import statistics
import sys
from pathlib import Path

os.environ["TVM_NUM_THREADS"] = "1"

import numpy as np  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402

from attnres_compile.backends.tvm import pipeline, rewrites  # noqa: E402
from attnres_compile.bench import timing  # noqa: E402
from attnres_compile.kernels import tir_pipeline  # noqa: E402
from attnres_compile.kernels.target import host_target  # noqa: E402

GEOMETRIES = {"smollm2-135m": (9, 3, 64), "llama 256": (4, 4, 64), "llama 1024": (4, 4, 256)}  # heads, kv, d
ROWS = 128


def scores_module(heads: int, kv: int, d: int, rows: int | None, keys: int | None) -> tvm.IRModule:
    b, s, t = (tvm.tirx.Var(n, "int64") for n in ("b", "s", "t"))
    s, t = (s if rows is None else rows), (t if keys is None else keys)
    q = relax.Var("q", relax.TensorType((b, heads, s, d), "float32"))
    k = relax.Var("k", relax.TensorType((b, kv, t, d), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k]):
        with bb.dataflow():
            heads_k = k
            if heads != kv:
                wide = bb.emit(relax.op.broadcast_to(bb.emit(relax.op.expand_dims(k, 2)), (b, kv, heads // kv, t, d)))
                heads_k = bb.emit(relax.op.reshape(wide, (b, heads, t, d)))
            flat = bb.emit(relax.op.reshape(heads_k, (b * heads, t, d)))
            swapped = bb.emit(relax.op.permute_dims(flat, [0, 2, 1]))
            scaled = bb.emit(relax.op.multiply(bb.emit(relax.op.reshape(swapped, (b, heads, d, t))),
                                               relax.const(0.125, "float32")))
            out = bb.emit_output(relax.op.matmul(q, scaled))
        bb.emit_func_output(out)
    return bb.get()


def build(mod: tvm.IRModule, always_rewrite: bool = False):
    target = host_target(1)
    saved = rewrites.PREFILL_ROWS
    rewrites.PREFILL_ROWS = 1 << 30 if always_rewrite else saved
    try:
        mod = pipeline.schedule(pipeline.prepare(mod, target), target)
    finally:
        rewrites.PREFILL_ROWS = saved
    ops = sorted({gv.name_hint.rstrip("0123456789") for gv, f in mod.functions_items()
                  if isinstance(f, tvm.tirx.PrimFunc)})
    exe = tvm.compile(mod, target, relax_pipeline=pipeline.finish(target), tir_pipeline=tir_pipeline.NAME)
    return relax.VirtualMachine(exe, tvm.cpu())["main"], ops


def main(out: Path) -> None:
    rng = np.random.default_rng(0)
    result = {"load_before": [round(x, 2) for x in os.getloadavg()], "geometries": {}}
    for name, (heads, kv, d) in GEOMETRIES.items():
        paths = {"dot, symbolic": build(scores_module(heads, kv, d, None, None)),
                 "gemm, symbolic keys": build(scores_module(heads, kv, d, ROWS, None)),
                 "gemm, static": build(scores_module(heads, kv, d, ROWS, ROWS)),
                 "dot, static": build(scores_module(heads, kv, d, ROWS, ROWS), always_rewrite=True)}
        q = rng.standard_normal((1, heads, ROWS, d)).astype("float32")
        k = rng.standard_normal((1, kv, ROWS, d)).astype("float32")
        expected = q @ (np.repeat(k, heads // kv, axis=1).swapaxes(-1, -2) * np.float32(0.125))
        args = [tvm.runtime.tensor(q), tvm.runtime.tensor(k)]
        errors = {p: float(np.abs(f(*args).numpy() - expected).max()) for p, (f, _) in paths.items()}
        samples = timing.interleaved_clocks({p: (lambda f=f: f(*args)) for p, (f, _) in paths.items()}, 5, 0.3)
        prefill = {p: statistics.median(s["cpu"]) * 1e6 for p, s in samples.items()}
        q1 = tvm.runtime.tensor(rng.standard_normal((1, heads, 1, d)).astype("float32"))
        k1 = tvm.runtime.tensor(rng.standard_normal((1, kv, ROWS + 1, d)).astype("float32"))
        step = timing.interleaved_clocks({"dot, symbolic": lambda: paths["dot, symbolic"][0](q1, k1)}, 5, 0.3)
        result["geometries"][name] = {
            "heads": heads, "kv_heads": kv, "head_dim": d, "operators": {p: ops for p, (_, ops) in paths.items()},
            "prefill_128_cpu_us": prefill, "max_abs_err_vs_numpy": errors,
            "step_1_over_129_cpu_us": {"dot, symbolic": statistics.median(step["dot, symbolic"]["cpu"]) * 1e6}}
        print(name, json.dumps({p: round(v, 1) for p, v in prefill.items()}), flush=True)
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
