"""Side-by-side CPU time of norms and softmax scheduled by `cpu_rules.RowReduction` and by dlight's
CPU `Reduction` rule (the default before), one operator at a time.

Each operator is legalized as a model's would be (`pipeline.prepare`), scheduled both ways, checked
to give the same numbers, and timed interleaved at 1 thread through TVM's VM (the call's overhead
included): the median over rounds of (RowReduction / dlight), with RowReduction's build timed a
second time as an identical copy (the noise floor). Also prints the bytes each call moves and the
rate that makes, against a [rows, D] float32 copy timed the same way (the memory roofline here:
the data fit in L2, so the copy's rate is cache bandwidth).

    python benchmarks/row_reduction_ab.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.s_tir import dlight

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attnres_compile.backends.tvm import cpu_rules, pipeline  # noqa: E402
from attnres_compile.bench import timing  # noqa: E402
from attnres_compile.kernels.target import host_target  # noqa: E402

OPERATORS = {"layer_norm [1, 128, 256]": (1, 128, 256), "rms_norm [1, 128, 256]": (1, 128, 256),
             "softmax [1, 4, 128, 128]": (1, 4, 128, 128), "layer_norm [1, 2048, 1024]": (1, 2048, 1024),
             "layer_norm [3, 100]": (3, 100)}


def legalized(name: str, shape: tuple) -> tvm.IRModule:
    from tvm.script import relax as R

    rng = np.random.default_rng(1)
    weight = [relax.const(rng.standard_normal(shape[-1]).astype("float32")) for _ in range(2)]
    bb = relax.BlockBuilder()
    x = relax.Var("x", R.Tensor(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            if name.startswith("layer_norm"):
                y = relax.op.nn.layer_norm(x, *weight, axes=[-1], epsilon=1e-5)
            elif name.startswith("rms_norm"):
                y = relax.op.nn.rms_norm(x, weight[0], axes=[-1], epsilon=1e-5)
            else:
                y = relax.op.nn.softmax(x, axis=-1)
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return pipeline.prepare(bb.get(), host_target(1))


def compiled(mod: tvm.IRModule, rules: list):
    target = host_target(1)
    with target:
        mod = dlight.ApplyDefaultSchedule(*rules)(mod)
    vm = relax.VirtualMachine(tvm.compile(mod, target=target, relax_pipeline=pipeline.finish(target)), tvm.cpu())
    return vm["main"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--min-time", type=float, default=0.05)
    args = parser.parse_args(argv)
    rules = {"this": [cpu_rules.RowReduction(), dlight.cpu.Reduction()], "dlight": [dlight.cpu.Reduction()]}
    print(f"{'operator':>28}  {'RowReduction us':>15}  {'dlight us':>9}  {'this/dlight':>11}  {'copy/this':>9}  "
          f"{'GB/s':>5}  {'copy GB/s':>9}")
    for name, shape in OPERATORS.items():
        x = tvm.runtime.tensor(np.random.default_rng(0).standard_normal(shape).astype("float32"))
        fns = {k: compiled(legalized(name, shape), r) for k, r in rules.items()}
        np.testing.assert_allclose(fns["this"](x).numpy(), fns["dlight"](x).numpy(), rtol=1e-5, atol=1e-5)
        source, dest = np.random.default_rng(2).standard_normal(shape).astype("float32"), np.empty(shape, "float32")
        calls = {"this": lambda: fns["this"](x), "dlight": lambda: fns["dlight"](x), "copy": lambda: fns["this"](x),
                 "memcpy": lambda: np.copyto(dest, source)}
        cpu = {k: v["cpu"] for k, v in timing.interleaved_clocks(calls, args.rounds, args.min_time).items()}
        median = {k: float(np.median(v)) for k, v in cpu.items()}
        moved = 2 * x.numpy().nbytes  # read the input once, write the output once: the floor
        print(f"{name:>28}  {median['this'] * 1e6:15.1f}  {median['dlight'] * 1e6:9.1f}  "
              f"{timing.paired_ratio(cpu['this'], cpu['dlight']):11.3f}  {timing.paired_ratio(cpu['copy'], cpu['this']):9.3f}  "
              f"{moved / median['this'] / 1e9:5.1f}  {moved / median['memcpy'] / 1e9:9.1f}")


if __name__ == "__main__":
    main()
