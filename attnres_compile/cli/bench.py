"""`attnres-compile bench kernel|model|block|decode|all`: run benchmarks, write JSON + table + PNG to --out.
This module only parses flags, fixes the thread count before any runtime starts its pool, and
writes each benchmark's `run`, `table` and `plot` results.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from ..core.errors import ConfigError
from . import args as cli_args

BENCHMARKS = {
    "kernel": "fused TVM kernel vs torch eager, torch.compile and onnxruntime, with the copy-bandwidth roofline",
    "model": "whole models: original, identical copy, Full and Block in torch eager (forward, forward + backward), "
             "onnxruntime and TVM; verdicts on the overhead, speed-against-onnxruntime and build-time targets",
    "block": "Block AttnRes: two-phase vs one-pass kernels, history memory of Block vs Full",
    "decode": "per-token decode cost with a KV cache: original, identical copy, Full and Block in torch eager, "
              "onnxruntime and TVM; verdicts on the per-token overhead targets",
}
ALL = ("kernel", "model", "block")  # `bench all`; decode has its own matrix flags and runs alone
# what each benchmark writes into --out (its plots where its data has them), checked before any work
RESULTS = {
    "kernel": ("kernel.json", "kernel.txt", "kernel_bandwidth.png", "kernel_speedup.png",
               "kernel_backward_bandwidth.png", "kernel_backward_speedup.png"),
    "model": ("model.json", "model.txt", "model_overhead.png", "model_latency.png", "model_vs_onnxruntime.png"),
    "block": ("block.json", "block.txt", "block_schedules.png", "block_history.png"),
    "decode": ("decode.json", "decode.txt", "decode_overhead.png", "decode_latency.png"),
}


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _names(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in choices]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(choices)}, got {text!r}")
        return values
    return parse


def add_command(subparsers) -> None:
    """Register `bench` (with kernel, model, block, all) on the main parser's subparsers."""
    bench = subparsers.add_parser("bench", help="measure what AttnRes costs (JSON, table and PNG plots)")
    sub = bench.add_subparsers(dest="benchmark", required=True)
    parsers = {name: sub.add_parser(name, help=text) for name, text in BENCHMARKS.items()}
    _decode_flags(parsers["decode"])
    parsers["all"] = sub.add_parser("all", help="kernel, model and block, one after the other")
    for name, p in parsers.items():
        p.add_argument("--out", default="bench-results", help="folder for NAME.json, NAME.txt and the plots "
                       "(default bench-results; files there are replaced only with --force)")
        p.add_argument("--force", action="store_true", help="replace results of an earlier run in --out")
        p.add_argument("--quick", action="store_true", help="a small matrix and few rounds: checks the set-up in a minute")
        p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to run (default cpu)")
        p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                       help="CPU threads for every runtime (default: all cores); bench model times at 1 thread "
                            "(CPU time) and at this many (wall time)")
        p.add_argument("--rounds", type=int, help="interleaved timing rounds (default 5, --quick 2)")
        cli_args.add_debug(p)
        p.set_defaults(run=bench_command, outputs=planned_outputs)
    for name in ("kernel", "all"):
        p = parsers[name]
        p.add_argument("--sources", type=_ints, help="S values (default 2,5,9,17,33)")
        p.add_argument("--rows", type=_ints, help="T values (default 128,2048,8192)")
        p.add_argument("--features", type=_ints, help="D values (default 256,1024,4096)")
        p.add_argument("--dtypes", type=_names(("float32", "float16")), help="default float32,float16")
        p.add_argument("--backends", type=_names(("tvm", "eager", "op", "compile", "onnxruntime")),
                       help="default all: tvm,eager,op,compile,onnxruntime (op: the custom op's eager reference; "
                            "the backward has no onnxruntime)")
        p.add_argument("--passes", type=_names(("forward", "backward")), help="default forward,backward")
    for name in ("model", "all"):
        p = parsers[name]
        p.add_argument("--models", type=_names(("gpt", "llama")), help="default gpt,llama")
        p.add_argument("--sublayers", type=_ints, help="depths in sublayers, two per layer (default: width 256 at "
                       "12,24,48 and width 1024 at 24; with --width: 12,24,48)")
        p.add_argument("--runtimes", type=_names(("eager", "train", "onnxruntime", "tvm", "tvm-tuned")),
                       help="default eager,train,onnxruntime,tvm (train: forward + backward in torch eager; tvm: the "
                            "default build), and tvm-tuned with --tune-minutes or --trials")
        p.add_argument("--width", type=int, help="hidden size (default: 256 and 1024, see --sublayers)")
        p.add_argument("--seq", type=int, help="tokens per sequence (default 128)")
        p.add_argument("--batch", type=int, help="sequences per forward (default 1)")
        p.add_argument("--blocks", type=int, default=8, help="N of the Block rewrite (default 8)")
        p.add_argument("--variants", type=_names(("full", "block", "delta", "delta-block")),
                       help="the rewrites timed beside the original and its identical copy (default full,block; "
                            "delta, delta-block: Delta AttnRes, the Block form with --blocks)")
        p.add_argument("--tune-minutes", type=float, help="also time a TVM build tuned with meta_schedule for this "
                       "many minutes (runtime tvm-tuned)")
        p.add_argument("--trials", type=int, help="also time a TVM build tuned with this many meta_schedule trials per "
                       "operator (runtime tvm-tuned; default 0: none)")
        p.add_argument("--profile", action="store_true", help="per-kernel (TVM) and per-node (onnxruntime) time by op "
                       "kind, original vs Full vs Block, at 1 thread")
        p.add_argument("--tuning-db", help="folder keeping TVM tuning records across runs (default OUT/tuning-db)")
    parsers["model"].add_argument("--factory", help="module:function returning (model, example_inputs) of an HF causal "
                                  "LM, e.g. samples.smollm2:factory: time that model at its own size instead")
    for name in ("model", "decode"):
        parsers[name].add_argument("--factory-timeout", type=cli_args.seconds, metavar="SECONDS",
                                   help="time limit of --factory, which runs in a child process with the memory "
                                        "limit of ATTNRES_COMPILE_MEMORY_LIMIT (default 600)")


def _decode_flags(p) -> None:
    p.add_argument("--models", type=_names(("llama", "gpt")), help="default llama")
    p.add_argument("--widths", type=_ints, help="hidden sizes (default 256,1024)")
    p.add_argument("--sublayers", type=_ints, help="depths in sublayers, two per layer (default 24,48)")
    p.add_argument("--runtimes", type=_names(("eager", "onnxruntime", "tvm", "generate")),
                   help="default eager,onnxruntime,tvm,generate (eager: the traced decoder with past, and HF's own "
                   "forward beside it; tvm: the .onnx compiled, default build; generate: HF generate() on the model "
                   "and through causal_lm; --quick: eager,onnxruntime)")
    p.add_argument("--factory", help="module:function returning (model, example_inputs) of an HF causal LM, e.g. "
                   "samples.smollm2:factory: time that model at its own size instead")
    p.add_argument("--prefill", type=int, help="prompt tokens before the timed decode steps (default 128)")
    p.add_argument("--steps", type=int, help="decode steps of one token per timed call (default 64)")
    p.add_argument("--blocks", type=int, default=8, help="N of the Block rewrite (default 8)")


def _chosen(args) -> list[str]:
    return list(ALL) if args.benchmark == "all" else [args.benchmark]


def planned_outputs(args) -> tuple[list, list, bool]:
    """(outputs, inputs, force) for outputs.check: every file the chosen benchmarks may write into --out
    (RESULTS), before any benchmark starts; --out must be a folder (or not exist yet)."""
    from ..utils.factory import factory_file
    from ..utils.outputs import Output

    out = Path(args.out)
    if os.path.lexists(out) and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder: give a folder for the results (created if missing)")
    planned = [Output(out / name, "--out") for bench in _chosen(args) for name in RESULTS[bench]]
    factory = getattr(args, "factory", None)
    inputs = [f for f in [factory_file(factory) if factory else None] if f]
    return planned, inputs, args.force


def _write(out: Path, name: str, module, data: dict, text: str) -> list[Path]:
    """NAME.json, NAME.txt and the plots, staged together and committed in one step (NAME.json last)."""
    from ..bench.results import write_json, write_text
    from ..core.errors import AttnResError
    from ..utils import outputs

    with outputs.staged(out / f"{name}.json") as stage:
        write_text(stage.folder / f"{name}.txt", text + "\n")
        plots = module.plot(data, stage.folder)
        undeclared = sorted({p.name for p in plots} - set(RESULTS[name]))
        if undeclared:
            raise AttnResError(f"internal error: bench {name} wrote {', '.join(undeclared)}, which the command did "
                               "not check before it started; nothing of it written; please report this")
        write_json(stage.path, data)
    return [out / f"{name}.json", out / f"{name}.txt", *(out / p.name for p in plots)]


def bench_command(args) -> int:
    """Run the chosen benchmark(s); print each table and the paths written."""
    if args.threads < 1:
        raise ConfigError(f"--threads must be a positive integer, got {args.threads}")
    if args.rounds is not None and args.rounds < 1:
        raise ConfigError(f"--rounds must be a positive integer, got {args.rounds}")
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # read when TVM's thread pool starts
    import torch

    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA GPU here; run on a GPU machine or drop --device cuda")
    args.rounds = args.rounds or (2 if args.quick else 5)
    out = Path(args.out)
    progress = sys.__stderr__  # the main CLI hides sys.stderr without --debug; progress stays visible
    names = _chosen(args)
    modules = {name: importlib.import_module(f"..bench.{name}", __package__) for name in names}
    for module in modules.values():  # every flag checked before any benchmark starts
        if hasattr(module, "settings"):
            module.settings(args)
    for name, module in modules.items():
        print(f"bench {name}: {BENCHMARKS[name]}", file=progress, flush=True)
        data = module.run(args, progress)
        text = module.table(data)
        written = _write(out, name, module, data, text)
        print(text)
        print("wrote " + ", ".join(str(p) for p in written))
    return 0
