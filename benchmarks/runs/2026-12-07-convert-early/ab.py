"""Cold `ac.convert` of SmolLM2 (KV-cache path), before (71f02fb) and after (the early builder), alternating.

    python benchmarks/runs/2026-12-07-convert-early/ab.py OLD_TREE NEW_TREE OUT.json [--rounds 5]

Each run is a fresh process with the model loaded before the clock and a new empty kernel cache
(bench_convert.py's CONVERT snippet); the 1-minute load is written beside each figure.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SNIPPET = """
import json, sys, time
sys.path.insert(0, {root!r})
import torch
from samples import smollm2
import attnres_compile as ac
assert ac.__file__.startswith({root!r}), ac.__file__
model, _ = smollm2.load()
t = time.perf_counter()
ac.convert(model, {config})
print(json.dumps({{"convert_s": time.perf_counter() - t}}))
"""
CONFIGS = {"block8": 'ac.AttnResConfig(variant="block", num_blocks=8)', "full": 'ac.AttnResConfig(variant="full")'}


def load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def run(root: str, config: str, cache: Path) -> float:
    done = subprocess.run([sys.executable, "-c", SNIPPET.format(root=root, config=config)], capture_output=True,
                          text=True, cwd=tempfile.gettempdir(), timeout=600,
                          env={**os.environ, "PYTHONPATH": root, "ATTNRES_KERNEL_CACHE": str(cache)})
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])["convert_s"]


def main() -> None:
    old, new, out = sys.argv[1:4]
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 5
    trees = {"before": old, "after": new}
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for r in range(rounds):
            for name, config in CONFIGS.items():
                for tree, root in trees.items():
                    cache = Path(work) / f"kc-{r}-{name}-{tree}"
                    before = load()
                    seconds = run(root, config, cache)
                    shutil.rmtree(cache, ignore_errors=True)
                    rows.append({"round": r, "config": name, "tree": tree, "convert_s": seconds,
                                 "load_before": before, "load_after": load()})
                    print(json.dumps(rows[-1]), flush=True)
    medians = {f"{c} {t}": statistics.median(x["convert_s"] for x in rows if x["config"] == c and x["tree"] == t)
               for c in CONFIGS for t in trees}
    Path(out).write_text(json.dumps({"runs": rows, "median_convert_s": medians}, indent=1))
    print(json.dumps(medians, indent=1))


if __name__ == "__main__":
    main()
