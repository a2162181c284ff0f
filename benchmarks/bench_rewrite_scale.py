"""Time chain analysis and the fx rewrite on synthetic chains of 250..2,000 links.

Analysis is about linear in graph size; Full's rewritten graph holds O(L^2) source
references (site k reads k+1 sources), Block's O(L*N). Prints JSON then a table.
    python benchmarks/bench_rewrite_scale.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

import attnres_compile as ac

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from samples.models import long_chain  # noqa: E402


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    x = torch.randn(2, 4)
    rows = []
    for links in (250, 500, 1000, 2000):
        row = {"links": links, "inspect_s": round(_seconds(lambda: ac.inspect(long_chain(links), (x,))), 3)}
        for name, cfg in (("block8", ac.AttnResConfig(variant="block", num_blocks=8)), ("full", ac.AttnResConfig())):
            row[f"rewrite_{name}_s"] = round(_seconds(lambda: ac.rewrite(long_chain(links), (x,), cfg, verify_outputs=False)), 3)
        rows.append(row)
    print(json.dumps(rows, indent=2))
    print(f"\n{'links':>6} {'inspect s':>10} {'block8 s':>9} {'full s':>8}")
    for r in rows:
        print(f"{r['links']:>6} {r['inspect_s']:>10} {r['rewrite_block8_s']:>9} {r['rewrite_full_s']:>8}")


if __name__ == "__main__":
    main()
