"""`bench kernel`: the fused depth-attention kernels (TVM) against the alternatives, over S x T x D.

Forward backends eager, op, compile, onnxruntime and tvm; backward backends eager, op, compile
and tvm; plus the machine's copy bandwidth as the memory-bound roofline (docs/bench.md,
*`bench kernel`*). Bytes: forward (S+1)*T*D*itemsize, backward (2S+1)*T*D*itemsize. Every result
is checked against a float64 reference on a sample of rows; TVM or onnxruntime off by more than
the dtype's tolerance raises (a bug, not a result). Shapes that would not fit are skipped.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import numpy as np
import psutil
import torch

from ..kernels.cache import target as tvm_target  # the block benchmark imports it from here too
from . import results
from .timing import CopyBandwidth, interleaved, sync_for

BACKENDS = ("tvm", "eager", "op", "compile", "onnxruntime")
BACKWARD_BACKENDS = ("tvm", "eager", "op", "compile")
PASSES = ("forward", "backward")
DEFAULT = {"sources": [2, 5, 9, 17, 33], "rows": [128, 2048, 8192], "features": [256, 1024, 4096],
           "dtypes": ["float32", "float16"]}
QUICK = {"sources": [2, 9], "rows": [128], "features": [256], "dtypes": ["float32"]}
EPS = 1e-6
CHECK_ROWS = 64  # rows compared against the float64 reference
TOLERANCE = {"float32": 1e-4, "float16": 2e-3}  # max |out - ref| / max |ref| for tvm and onnxruntime
MEMORY_FRACTION = 0.6  # of the available memory a shape may plan to use
# extra S*T*D tensors each backend allocates beyond the sources (itemsize: storage, or 4 = float32)
EXTRA = {"tvm": (0, None), "eager": (4, None), "op": (0, None), "compile": (2, None), "onnxruntime": (4, 4)}
# the backward's, beyond sources, g and the S gradients: autograd's saved stacked tensors, the op's
# float32 per-source temporaries, inductor's saved activations
EXTRA_BACKWARD = {"tvm": (0, None), "eager": (5, None), "op": (2, 4), "compile": (3, None)}
TARGET_SHAPE = {"S": 9, "T": 2048, "D": 1024, "dtype": "float32"}


def unfused(eps: float, scale: float) -> Callable:
    """The paper's pseudocode in torch: stack, RMSNorm, logits, softmax over sources, weighted sum."""
    def depth_attention(srcs: list[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
        V = torch.stack(srcs)
        K = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps)
        z = torch.einsum("d,srd->sr", w, K)
        p = z.softmax(0)
        return scale * torch.einsum("sr,srd->rd", p, V)
    return depth_attention


def reference(srcs: list[torch.Tensor], w: torch.Tensor, eps: float, scale: float) -> torch.Tensor:
    """The formula (DESIGN.md §2) in float64 on the CPU."""
    V = torch.stack([s.double().cpu() for s in srcs])
    z = (V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps) * w.double().cpu()).sum(-1)
    return scale * (z.softmax(0).unsqueeze(-1) * V).sum(0)


class Group:
    """The backends of one (S, D, dtype), set up lazily and reused for every T.

    `setup_s` holds the seconds each set-up took (TVM build, onnxruntime session, torch.compile's
    first call), reported on the row that paid for it."""

    def __init__(self, S: int, D: int, dtype: str, device: str, threads: int):
        self.S, self.D, self.dtype, self.device, self.threads = S, D, dtype, device, threads
        # the query, exact in the storage dtype; fixed per group (onnxruntime holds it as an initializer)
        w = torch.randn(D, generator=torch.Generator().manual_seed(D)) / D**0.5
        self.w = w.to(getattr(torch, dtype)).float().to(device)
        self.eager = unfused(EPS, float(S))
        self.built: dict[str, object] = {}
        self.setup_s: dict[str, float] = {}

    def _once(self, name: str, make: Callable[[], object]):
        if name not in self.built:
            start = time.perf_counter()
            self.built[name] = make()
            self.setup_s[name] = time.perf_counter() - start
        return self.built[name]

    def candidate(self, name: str, srcs: list[torch.Tensor], w: torch.Tensor, out: torch.Tensor) -> Callable:
        """A no-argument call of backend `name` on these tensors; tvm and onnxruntime write `out`."""
        if name == "eager":
            w_store = w.to(srcs[0].dtype)
            return lambda: self.eager(srcs, w_store)
        if name == "op":
            from ..ops.depth_attention import forward_reference

            return lambda: forward_reference(srcs, w, EPS, float(self.S), -1)
        if name == "compile":
            w_store = w.to(srcs[0].dtype)
            for s in srcs:
                torch._dynamo.mark_dynamic(s, 0)

            def first_call():  # compiles: its time is the compile time, cold (no on-disk cache hit)
                compiled = torch.compile(self.eager)
                with torch._inductor.config.patch(force_disable_caches=True):
                    compiled(srcs, w_store)
                return compiled

            compiled = self._once("compile", first_call)
            return lambda: compiled(srcs, w_store)
        if name == "tvm":
            import tvm

            kernel = self._once("tvm", lambda: _tvm_build(self.S, self.D, self.dtype, self.device, self.threads))
            args = [tvm.runtime.from_dlpack(t) for t in (*srcs, w, out)]
            return lambda: kernel(*args)
        if name == "onnxruntime":
            session = self._once("onnxruntime", lambda: _ort_session(self.S, self.w, self.dtype, self.device,
                                                                     self.threads))
            return _ort_call(session, srcs, out)
        raise ValueError(f"unknown backend {name!r}")

    def backward_candidate(self, name: str, srcs: list[torch.Tensor], w: torch.Tensor, g: torch.Tensor,
                           grads: list[torch.Tensor], dw: torch.Tensor) -> Callable:
        """A no-argument backward of backend `name`: returns (source gradients, query gradient), or
        None after writing `grads` and `dw` (tvm)."""
        if name == "tvm":
            kernel = self._once("tvm_backward", lambda: _tvm_build(self.S, self.D, self.dtype, self.device,
                                                                   self.threads, backward=True))
            return lambda: kernel(*srcs, w, g, *grads, dw)
        if name == "op":
            from ..ops.depth_attention import backward_reference

            return lambda: backward_reference(srcs, w, g, EPS, float(self.S), -1)
        leaves = [s.detach().requires_grad_() for s in srcs]
        w_leaf = w.detach().to(srcs[0].dtype, copy=True).requires_grad_()
        inputs = [*leaves, w_leaf]
        if name == "eager":
            out = self.eager(leaves, w_leaf)
        elif name == "compile":
            for s in leaves:
                torch._dynamo.mark_dynamic(s, 0)

            def first_call():  # compiles forward and backward graphs, cold; the backward is timed
                compiled = torch.compile(unfused(EPS, float(self.S)))
                with torch._inductor.config.patch(force_disable_caches=True):
                    result = compiled(leaves, w_leaf)
                    torch.autograd.grad(result, inputs, g, retain_graph=True)
                return compiled

            out = self._once("compile_backward", first_call)(leaves, w_leaf)
        else:
            raise ValueError(f"unknown backward backend {name!r}")

        def run():
            *source_grads, w_grad = torch.autograd.grad(out, inputs, g, retain_graph=True)
            return source_grads, w_grad
        return run


def _tvm_build(S: int, D: int, dtype: str, device: str, threads: int, backward: bool = False):
    from ..kernels.schedule import build
    from ..kernels.tensorir import depth_attention_backward_func, depth_attention_func

    make = depth_attention_backward_func if backward else depth_attention_func
    return build(make(S, D, dtype, EPS, float(S)), tvm_target(device, threads))


def _ort_session(S: int, w: torch.Tensor, dtype: str, device: str, threads: int):
    """An onnxruntime session of one DepthAttention site over S [rows, D] sources, query `w`."""
    import onnx
    import onnx.numpy_helper
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from ..onnx import function as onnx_function

    D = w.numel()
    elem = TensorProto.FLOAT16 if dtype == "float16" else TensorProto.FLOAT
    names = [f"s{i}" for i in range(S)]
    node = onnx_function.site_node(names, "w", "out", eps=EPS, scale=float(S), axis=-1, rank=2, name="site")
    graph = helper.make_graph(
        [node], "depth_attention",
        [helper.make_tensor_value_info(n, elem, ["rows", D]) for n in names],
        [helper.make_tensor_value_info("out", elem, ["rows", D])],
        initializer=[onnx.numpy_helper.from_array(w.cpu().numpy(), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx_function.attach_functions(model)
    onnx.checker.check_model(model, full_check=True)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    provider = "CUDAExecutionProvider" if device == "cuda" else "CPUExecutionProvider"
    return ort.InferenceSession(model.SerializeToString(), opts, providers=[provider])


def _ort_call(session, srcs: list[torch.Tensor], out: torch.Tensor) -> Callable:
    """Bind the torch tensors in place (no copies, output preallocated as for TVM) and run."""
    binding = session.io_binding()
    device = out.device.type
    for name, t in ((f"s{i}", s) for i, s in enumerate(srcs)):
        binding.bind_input(name, device, 0, _numpy_dtype(t), list(t.shape), t.data_ptr())
    binding.bind_output("out", device, 0, _numpy_dtype(out), list(out.shape), out.data_ptr())
    return lambda: session.run_with_iobinding(binding)


def _numpy_dtype(t: torch.Tensor):
    return np.float16 if t.dtype == torch.float16 else np.float32


def _unavailable(backends: list[str], device: str) -> dict[str, str]:
    """{backend: reason} for requested backends this machine cannot run at all."""
    skipped = {}
    if device == "cuda" and "onnxruntime" in backends:
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            skipped["onnxruntime"] = "onnxruntime has no CUDAExecutionProvider here"
    return skipped


def available_bytes(device: str) -> int:
    """Memory free for a shape now: host RAM, or the GPU's free memory on cuda."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    return psutil.virtual_memory().available


def memory_plan(S: int, T: int, D: int, dtype: str, backends: list[str], budget: int,
                pass_: str = "forward") -> tuple[str | None, dict]:
    """(reason the whole shape is skipped or None, {backend: reason it is skipped}) against `budget` bytes."""
    itemsize = getattr(torch, dtype).itemsize
    base = _bytes(S, T, D, itemsize, pass_)
    gb = 1e9
    if base > budget:
        return f"{'sources and output' if pass_ == 'forward' else 'sources, g and gradients'} need " \
               f"{base / gb:.1f} GB, {budget / gb:.1f} GB available", {}
    skipped = {}
    for name in backends:
        copies, size = (EXTRA if pass_ == "forward" else EXTRA_BACKWARD)[name]
        need = base + copies * S * T * D * (size or itemsize)
        if need > budget:
            skipped[name] = f"estimated peak {need / gb:.1f} GB, {budget / gb:.1f} GB available"
    return None, skipped


def _bytes(S: int, T: int, D: int, itemsize: int, pass_: str) -> int:
    """What the pass must move: the forward reads S sources and writes the output; the backward
    reads S sources and g and writes S gradients."""
    return ((S + 1) if pass_ == "forward" else (2 * S + 1)) * T * D * itemsize


def _max_rel_err(out: torch.Tensor, idx: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out[idx].double().cpu() - ref).abs().max() / ref.abs().max()).item()


def _sources(S: int, T: int, D: int, dtype: torch.dtype, device: str, seed: int) -> list[torch.Tensor]:
    """S sources of differing RMS, so the softmax weights differ."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(T, D, generator=gen) * (0.5 + i / S)).to(device, dtype) for i in range(S)]


def _timed(row: dict, entries: dict, candidates: dict, copy: CopyBandwidth, rounds: int, min_time: float,
           sync) -> dict:
    """Time the candidates interleaved with the copy; fill the row's GB/s, fractions and speedups."""
    candidates["copy"] = copy.fn
    times = interleaved(candidates, rounds, min_time, sync)
    copy_gbps = copy.gbps(times.pop("copy")["median_ms"])
    row["copy_GBps"] = copy_gbps
    for name, t in times.items():
        gbps = row["bytes"] / (t["median_ms"] * 1e-3) / 1e9
        entries[name].update(median_ms=t["median_ms"], min_ms=t["min_ms"], GBps=gbps, fraction_of_copy=gbps / copy_gbps)
    row["backends"] = entries
    if "tvm" in times:
        row["tvm_speedup"] = {n: t["median_ms"] / times["tvm"]["median_ms"] for n, t in times.items() if n != "tvm"}
    return row


def measure(group: Group, T: int, backends: list[str], skipped: dict[str, str], copy: CopyBandwidth,
            rounds: int, min_time: float, seed: int = 0) -> dict:
    """One row: every backend on S sources of [T, D], timed interleaved with the copy."""
    S, D, dtype, device = group.S, group.D, group.dtype, group.device
    torch_dtype = getattr(torch, dtype)
    srcs = _sources(S, T, D, torch_dtype, device, seed)
    w = group.w  # exact in the storage dtype
    out = torch.empty(T, D, dtype=torch_dtype, device=device)
    idx = torch.linspace(0, T - 1, min(T, CHECK_ROWS), device=device).long().unique()
    ref = reference([s[idx] for s in srcs], w, EPS, float(S))
    sync = sync_for(device)

    row: dict = {"pass": "forward", "S": S, "T": T, "D": D, "dtype": dtype,
                 "bytes": _bytes(S, T, D, torch_dtype.itemsize, "forward")}
    entries: dict[str, dict] = {}
    candidates: dict[str, Callable] = {}
    for name in backends:
        if name in skipped:
            entries[name] = {"skipped": skipped[name]}
            continue
        had_setup = name in group.setup_s
        fn = group.candidate(name, srcs, w, out)
        result = fn()
        sync()
        err = _max_rel_err(out if result is None else result, idx, ref)
        del result
        if name in ("tvm", "onnxruntime") and not err <= TOLERANCE[dtype]:
            raise AssertionError(f"{name} is wrong at S={S} T={T} D={D} {dtype}: max relative error {err:.2e} "
                                 f"> {TOLERANCE[dtype]:.0e} against the float64 reference")
        entries[name] = {"max_rel_err": err}
        if not had_setup and name in group.setup_s:
            entries[name]["setup_s"] = group.setup_s[name]
        candidates[name] = fn
    return _timed(row, entries, candidates, copy, rounds, min_time, sync)


def measure_backward(group: Group, T: int, backends: list[str], skipped: dict[str, str], copy: CopyBandwidth,
                     rounds: int, min_time: float, seed: int = 0) -> dict:
    """One backward row: every backend's gradients on S sources of [T, D], timed interleaved with the copy."""
    from ..ops.depth_attention import backward_reference

    S, D, dtype, device = group.S, group.D, group.dtype, group.device
    torch_dtype = getattr(torch, dtype)
    srcs = _sources(S, T, D, torch_dtype, device, seed)
    w = group.w
    g = torch.randn(T, D, generator=torch.Generator().manual_seed(seed + 1)).to(device, torch_dtype)
    grads = [torch.empty(T, D, dtype=torch_dtype, device=device) for _ in range(S)]
    dw = torch.empty(D, device=device)
    idx = torch.linspace(0, T - 1, min(T, CHECK_ROWS), device=device).long().unique()
    # float64 on the sampled rows: the source gradients there, and the query gradient of those rows alone
    ref_grads, ref_dw = backward_reference([s[idx].double().cpu() for s in srcs], w.double().cpu(),
                                           g[idx].double().cpu(), EPS, float(S), -1)
    sync = sync_for(device)
    row: dict = {"pass": "backward", "S": S, "T": T, "D": D, "dtype": dtype,
                 "bytes": _bytes(S, T, D, torch_dtype.itemsize, "backward")}
    entries: dict[str, dict] = {}
    candidates: dict[str, Callable] = {}
    for name in backends:
        if name not in BACKWARD_BACKENDS:
            continue
        if name in skipped:
            entries[name] = {"skipped": skipped[name]}
            continue
        setup_key = f"{name}_backward" if name in ("tvm", "compile") else name
        had_setup = setup_key in group.setup_s
        fn = group.backward_candidate(name, srcs, w, g, grads, dw)
        result = fn()
        sync()
        source_grads = grads if result is None else result[0]
        err = max(_max_rel_err(mine, idx, ref) for mine, ref in zip(source_grads, ref_grads))
        del result, source_grads
        entries[name] = {"max_rel_err": err}
        if name == "tvm":  # the query gradient sums over rows: the kernel again on the sampled rows
            sub = [torch.empty(len(idx), D, dtype=torch_dtype, device=device) for _ in range(S)]
            sub_dw = torch.empty(D, device=device)
            group.backward_candidate(name, [s[idx].contiguous() for s in srcs], w, g[idx].contiguous(), sub,
                                     sub_dw)()
            sync()
            entries[name]["max_rel_err_query"] = ((sub_dw.double().cpu() - ref_dw).abs().max()
                                                  / ref_dw.abs().max()).item()
            err = max(err, entries[name]["max_rel_err_query"])
            if not err <= TOLERANCE[dtype]:
                raise AssertionError(f"tvm backward is wrong at S={S} T={T} D={D} {dtype}: max relative error "
                                     f"{err:.2e} > {TOLERANCE[dtype]:.0e} against the float64 reference")
        if not had_setup and setup_key in group.setup_s:
            entries[name]["setup_s"] = group.setup_s[setup_key]
        candidates[name] = fn
    return _timed(row, entries, candidates, copy, rounds, min_time, sync)


def run(args, progress: TextIO) -> dict:
    """The benchmark matrix from `args` (None fields: defaults, or the quick matrix with --quick)."""
    defaults = QUICK if args.quick else DEFAULT
    config = {key: getattr(args, key, None) or defaults[key] for key in DEFAULT}
    backends = list(getattr(args, "backends", None) or BACKENDS)
    passes = list(getattr(args, "passes", None) or PASSES)
    device, threads, rounds = args.device, args.threads, args.rounds or (2 if args.quick else 5)
    os.environ.setdefault("TVM_NUM_THREADS", str(threads))  # effective only if TVM's pool has not started
    import tvm

    min_time = 0.02 if args.quick else 0.1
    # compile in this process: inductor's default pool of compile subprocesses keeps both cores
    # busy for tens of seconds after the first compile and slowed the first rows' eager 2-5x
    torch._inductor.config.compile_threads = 1
    torch._functorch.config.donated_buffer = False  # the compiled backward runs repeatedly on one graph
    config.update(backends=backends, passes=passes, rounds=rounds, min_time=min_time, eps=EPS, scale="S (preserve)",
                  check_rows=CHECK_ROWS, tolerance=TOLERANCE, tvm_threads=tvm.runtime.num_threads())
    unavailable = _unavailable(backends, device)
    copy = CopyBandwidth(device=device)
    rows, start = [], time.perf_counter()
    total = len(config["dtypes"]) * len(config["features"]) * len(config["sources"]) * len(config["rows"]) * len(passes)
    for dtype in config["dtypes"]:
        for D in config["features"]:
            for S in config["sources"]:
                torch._dynamo.reset()  # one compile per (S, D, dtype), rows dynamic: no recompile limit to hit
                group = Group(S, D, dtype, device, threads)
                for T in config["rows"]:
                    for pass_ in passes:
                        budget = int(available_bytes(device) * MEMORY_FRACTION)
                        names = backends if pass_ == "forward" else [b for b in backends if b in BACKWARD_BACKENDS]
                        shape_skip, skipped = memory_plan(S, T, D, dtype, names, budget, pass_)
                        if shape_skip:
                            row = {"pass": pass_, "S": S, "T": T, "D": D, "dtype": dtype, "skipped": shape_skip}
                        else:
                            run_pass = measure if pass_ == "forward" else measure_backward
                            row = run_pass(group, T, names, {**skipped, **unavailable}, copy, rounds, min_time)
                        rows.append(row)
                        print(f"[{len(rows)}/{total} {time.perf_counter() - start:6.0f}s] {_summary(row)}",
                              file=progress, flush=True)
    return {"benchmark": "kernel", "environment": results.environment(threads, device), "config": config,
            "copy_bandwidth_GBps": statistics.median([r["copy_GBps"] for r in rows if "copy_GBps" in r] or [0.0]),
            "rows": rows, "targets": targets(rows)}


def _summary(row: dict) -> str:
    shape = f"{row.get('pass', 'forward')} S={row['S']} T={row['T']} D={row['D']} {row['dtype']}"
    if "skipped" in row:
        return f"{shape}: skipped ({row['skipped']})"
    times = ", ".join(f"{n} {e['median_ms']:.3g} ms" if "median_ms" in e else f"{n} skipped"
                      for n, e in row["backends"].items())
    return f"{shape}: {times}, copy {row['copy_GBps']:.1f} GB/s"


def _pass(rows: list[dict], pass_: str) -> list[dict]:
    return [r for r in rows if r.get("pass", "forward") == pass_]


def targets(rows: list[dict]) -> list[dict]:
    """The CPU targets at S=9, T=2048, D=1024, float32 (empty when that shape was not measured):
    forward tvm >= 10x eager, >= 3x torch.compile, >= 60% of copy bandwidth; backward tvm >= 60%."""
    def at_target(pass_):
        return next((r for r in _pass(rows, pass_) if all(r.get(k) == v for k, v in TARGET_SHAPE.items())
                     and "skipped" not in r), None)

    checks = []
    forward, backward = at_target("forward"), at_target("backward")
    if forward is not None:
        speedup = forward.get("tvm_speedup", {})
        checks += [("tvm speedup over eager", ">= 10x", speedup.get("eager"), 10.0),
                   ("tvm speedup over compile", ">= 3x", speedup.get("compile"), 3.0),
                   ("tvm fraction of copy bandwidth", ">= 0.6", forward["backends"].get("tvm", {}).get("fraction_of_copy"),
                    0.6)]
    if backward is not None:
        checks.append(("tvm backward fraction of copy bandwidth", ">= 0.6",
                       backward["backends"].get("tvm", {}).get("fraction_of_copy"), 0.6))
    return [{"name": name, "target": target, "measured": value, "met": None if value is None else value >= bound}
            for name, target, value, bound in checks]


def _pass_table(rows: list[dict], backends: list[str], title: str) -> list[str]:
    """Times, bandwidth, speedups, errors and set-up times of one pass's rows."""
    flat, setups, notes = [], {}, []
    for r in rows:
        line = {k: r[k] for k in ("S", "T", "D", "dtype")}
        shape = f"S={r['S']} T={r['T']} D={r['D']} {r['dtype']}"
        if "skipped" in r:
            notes.append(f"{title} {shape}: skipped, {r['skipped']}")
        for name, e in r.get("backends", {}).items():
            line[f"{name}_ms"], line[f"{name}_pct"] = e.get("median_ms"), _pct(e.get("fraction_of_copy"))
            line[f"{name}_err"], line[f"x_{name}"] = e.get("max_rel_err"), r.get("tvm_speedup", {}).get(name)
            if "skipped" in e:
                notes.append(f"{title} {shape}: {name} skipped, {e['skipped']}")
            if "setup_s" in e:
                setups.setdefault((r["S"], r["D"], r["dtype"]), {})[name] = e["setup_s"]
        line["copy_GBps"], line["tvm_GBps"] = r.get("copy_GBps"), r.get("backends", {}).get("tvm", {}).get("GBps")
        flat.append(line)
    shape_cols = [("S", "S", ""), ("T", "T", ""), ("D", "D", ""), ("dtype", "dtype", "")]
    others = [b for b in backends if b != "tvm"]
    parts = [
        f"{title}: median ms per call (and % of copy bandwidth)",
        results.table(flat, shape_cols + [c for b in backends
                                        for c in ((f"{b}_ms", b, ".3f"), (f"{b}_pct", "%copy", ".0f"))]
                      + [("tvm_GBps", "tvm GB/s", ".1f"), ("copy_GBps", "copy GB/s", ".1f")]),
        "",
        f"{title}: tvm speedup over each backend, and max relative error against float64",
        results.table(flat, shape_cols + [(f"x_{b}", f"x {b}", ".2f") for b in others]
                      + [(f"{b}_err", f"err {b}", ".1e") for b in backends]),
    ]
    if setups:
        setup_rows = [{"S": S, "D": D, "dtype": dtype, **s} for (S, D, dtype), s in setups.items()]
        parts += ["", f"{title}: set-up seconds per (S, D, dtype): tvm build, onnxruntime session, "
                      "torch.compile first call",
                  results.table(setup_rows, shape_cols[:1] + shape_cols[2:]
                                + [(b, b, ".2f") for b in backends if b != "eager"])]
    return parts + ([""] + notes if notes else [])


def table(data: dict) -> str:
    """Per pass: times, bandwidth and speedups per shape, errors, set-up times; then the targets."""
    backends = data["config"]["backends"]
    parts = []
    for pass_ in data["config"].get("passes", ["forward"]):
        names = backends if pass_ == "forward" else [b for b in backends if b in BACKWARD_BACKENDS]
        rows = _pass(data["rows"], pass_)
        if rows:
            parts += (["", ""] if parts else []) + _pass_table(rows, names, pass_)
    shape = "S={S} T={T} D={D} {dtype}".format(**TARGET_SHAPE)
    parts += ["", f"targets at {shape}:" if data["targets"] else f"targets: {shape} not measured"]
    for t in data["targets"]:
        measured = "not measured" if t["measured"] is None else f"{t['measured']:.2f}"
        verdict = "-" if t["met"] is None else "met" if t["met"] else "NOT MET"
        parts.append(f"  {t['name']} {t['target']}: {measured} ({verdict})")
    return "\n".join(parts)


def _pct(fraction: float | None) -> float | None:
    return None if fraction is None else 100 * fraction


def plot(data: dict, out_dir: Path) -> list[Path]:
    """kernel_bandwidth.png (fraction of copy bandwidth vs S) and kernel_speedup.png (tvm over
    the others vs S), and kernel_backward_*.png for the backward: one panel per D, at T=2048 or
    the largest T measured; a line per backend and dtype (float16 dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = data["config"]["backends"]
    paths = []
    for pass_ in data["config"].get("passes", ["forward"]):
        measured = [r for r in _pass(data["rows"], pass_) if "skipped" not in r]
        if not measured:
            continue
        rows_present = {r["T"] for r in measured}
        T = 2048 if 2048 in rows_present else max(rows_present)
        sel = [r for r in measured if r["T"] == T]
        features = sorted({r["D"] for r in sel})
        dtypes = [d for d in data["config"]["dtypes"] if any(r["dtype"] == d for r in sel)]
        names = backends if pass_ == "forward" else [b for b in backends if b in BACKWARD_BACKENDS]
        prefix = "kernel" if pass_ == "forward" else "kernel_backward"
        for name, title, value, lines, log in [
            (f"{prefix}_bandwidth.png", "fraction of copy bandwidth",
             lambda r, b: r["backends"].get(b, {}).get("fraction_of_copy"), names, False),
            (f"{prefix}_speedup.png", "tvm speedup over each backend", lambda r, b: r.get("tvm_speedup", {}).get(b),
             [b for b in names if b != "tvm"], True),
        ]:
            fig, axes = plt.subplots(1, len(features), figsize=(4.5 * len(features), 3.8), squeeze=False, sharey=True)
            for ax, D in zip(axes[0], features):
                for dtype in dtypes:
                    for b in lines:
                        pts = sorted((r["S"], value(r, b)) for r in sel
                                     if r["D"] == D and r["dtype"] == dtype and value(r, b) is not None)
                        if pts:
                            ax.plot(*zip(*pts), marker="o", color=f"C{backends.index(b)}",
                                    linestyle="--" if dtype == "float16" else "-", label=f"{b} {dtype}")
                ax.axhline(1.0, color="grey", linewidth=0.8)  # copy bandwidth; break-even speedup
                if log:
                    ax.set_yscale("log")
                ax.set_xscale("log", base=2)
                ax.set_xticks(sorted({r["S"] for r in sel}), [str(S) for S in sorted({r["S"] for r in sel})])
                ax.set_title(f"D={D}, T={T}")
                ax.set_xlabel("sources S")
                ax.grid(True, alpha=0.3)
            axes[0][0].set_ylabel(title)
            axes[0][-1].legend(fontsize=7)
            fig.suptitle(f"depth attention {pass_}: {title} ({data['environment'].get('device', 'cpu')})")
            paths.append(results.save_figure(fig, out_dir / name))
    return paths
