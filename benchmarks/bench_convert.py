"""Issue 65's figures for `ac.convert` on SmolLM2-135M: load, convert and a bf16 training step.

    python benchmarks/bench_convert.py --out benchmarks/runs/DATE-convert [--rounds 5] [--only load,convert,train]

Each part writes `<part>.json` (the readings, their medians and ratios, `uptime` beside each round)
into the --out folder and prints it.

- load: `from_pretrained` of the converted folder (`trust_remote_code=True`) against the base
  model's own folder and against an identical copy of the base folder (the control: what two
  loads of the same thing differ by), each in a fresh process (torch and transformers imported
  before the clock starts; the converted load's import of attnres-compile counts), rounds
  alternating; medians and ratios over the base.
- convert: `ac.convert` of SmolLM2 (its KV-cache path) with a cold kernel cache (a new
  ATTNRES_KERNEL_CACHE per run), Block(8) and Full, each in a fresh process with the model loaded
  before the clock; the trace + rewrite + outlining part timed on its own beside it.
- train: one bf16 training step (`.to(torch.bfloat16)`, forward, backward, SGD step; 2 x 32
  tokens of text; 1 thread, process CPU time; bf16 matmuls are slow on a CPU without bf16 units:
  ~58 s a step at 4 x 64) of the converted model (Block(8), width 576) against the original and
  against an identical copy of the original, rounds alternating.

Every figure is written beside the machine's load (`uptime`) at the time.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _python(code: str, env: dict | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


LOAD = """
import json, time, torch, transformers as tf
t = time.perf_counter()
model = tf.AutoModelForCausalLM.from_pretrained({folder!r}, trust_remote_code=True, dtype=torch.float32)
seconds = time.perf_counter() - t
print(json.dumps({{"seconds": seconds, "class": type(model).__name__}}))
"""


def bench_load(work: Path, rounds: int) -> dict:
    from samples import smollm2

    import attnres_compile as ac

    model, _ = smollm2.load()
    base = smollm2.dense_folder()
    copy_dir = work / "base-copy"
    shutil.copytree(base, copy_dir, dirs_exist_ok=True)
    converted = work / "converted"
    ac.convert(model, ac.AttnResConfig(variant="block", num_blocks=8)).save_pretrained(converted)
    folders = {"base": base, "identical copy": copy_dir, "converted": converted}
    times: dict[str, list[float]] = {k: [] for k in folders}
    loads = []
    _python(LOAD.format(folder=str(converted)))  # warm the OS file cache and transformers' module cache
    for _ in range(rounds):
        for name, folder in folders.items():
            times[name].append(_python(LOAD.format(folder=str(folder)))["seconds"])
        loads.append(uptime())
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"seconds": times, "median": med, "ratio_converted": med["converted"] / med["base"],
            "ratio_copy": med["identical copy"] / med["base"], "uptime": loads}


CONVERT = """
import json, sys, time, torch
sys.path.insert(0, {root!r})
from samples import smollm2
import attnres_compile as ac
model, _ = smollm2.load()
config = {config}
t = time.perf_counter()
ac.convert(model, config)
total = time.perf_counter() - t
from attnres_compile.hf import conversion
t = time.perf_counter()
conversion._state(model.get_decoder(), config, None)
print(json.dumps({{"convert_s": total, "trace_rewrite_outline_s": time.perf_counter() - t}}))
"""


def bench_convert(work: Path, rounds: int) -> dict:
    configs = {"block8": 'ac.AttnResConfig(variant="block", num_blocks=8)', "full": 'ac.AttnResConfig(variant="full")'}
    out = {}
    for name, config in configs.items():
        runs = []
        for r in range(rounds):
            cache = work / f"kernels-{name}-{r}"
            row = _python(CONVERT.format(root=str(ROOT), config=config), {"ATTNRES_KERNEL_CACHE": str(cache)})
            row["uptime"] = uptime()
            runs.append(row)
            shutil.rmtree(cache, ignore_errors=True)
        out[name] = {"runs": runs, "median_convert_s": statistics.median(r["convert_s"] for r in runs)}
    return out


def bench_train(rounds: int, tokens: int = 32, batch: int = 2) -> dict:
    import torch

    from samples import smollm2

    import attnres_compile as ac

    torch.set_num_threads(1)
    model, tokenizer = smollm2.load()
    ids = tokenizer(smollm2.text(20_000), return_tensors="pt")["input_ids"][0][:batch * tokens].view(batch, tokens)
    arms = {"original": copy.deepcopy(model), "identical copy": copy.deepcopy(model),
            "converted": ac.convert(model, ac.AttnResConfig(variant="block", num_blocks=8))}
    arms = {k: m.to(torch.bfloat16).train() for k, m in arms.items()}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in arms.items()}

    def step(name):
        m = arms[name]
        t = time.process_time()
        loss = m(ids, labels=ids).loss
        loss.backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        return time.process_time() - t

    for name in arms:  # warm-up: kernels, the bf16 trace of the converted model
        step(name)
    times: dict[str, list[float]] = {k: [] for k in arms}
    loads = []
    for _ in range(rounds):
        for name in arms:
            times[name].append(step(name))
        loads.append(uptime())
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"cpu_seconds": times, "median": med, "ratio_converted": med["converted"] / med["original"],
            "ratio_copy": med["identical copy"] / med["original"], "uptime": loads,
            "shape": [batch, tokens], "width": 576, "threads": 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="load,convert,train")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    parts = {"load": bench_load, "convert": bench_convert, "train": lambda work, rounds: bench_train(rounds)}
    with tempfile.TemporaryDirectory() as work:
        for part in args.only.split(","):
            start = uptime()
            print(f"{part} ... ({start})", flush=True)
            result = {"start": start, **parts[part](Path(work), args.rounds), "end": uptime()}
            (out / f"{part}.json").write_text(json.dumps(result, indent=1))
            print(json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()
