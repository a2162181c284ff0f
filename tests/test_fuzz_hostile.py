"""Hostile files of every class of issue 14 through the CLI (forked `main`, see forked_cli.py).

Cases come from tests/hostile.py: byte-level and protobuf-level damage, nested and endless
subgraphs, spoofed attnres functions, external data, names, onnxruntime crashes and memory bombs,
hostile output paths, --force over inputs (their weights, their folder), FIFOs, device nodes and
folders where files belong, crafted .pt2 archives (every code-execution vector, marker payloads),
bad factories, Ctrl-C / SIGTERM at random moments, edge-case verdicts (eps out of range, empty and
integer-only outputs, zero rows), poisoned kernel caches, and (issue 62) onnxruntime-genai folders
(config fields, libraries to load, files to write, malformed and symlinked configs, odd sidecars, for
`generate` and `rewrite`), `inspect --budget` layouts (with SIGTERM) and `generate` prompt arguments.
Each run must end with a documented exit
code from the case's set, one error line, no traceback, no signal death, no run past its time
limit, nothing left behind, no input changed, no payload run, no false verdict (hostile.judge).

CI runs a fixed-seed sample for FUZZ_BUDGET seconds (default 30) after one case of each class (under
60 s in all, some 50 to 100 cases); `python tests/test_fuzz_hostile.py --cases 5000 --seed N` twice
(two seeds) is the long run, which prints the counts by exit code and by failure class
(benchmarks/runs/fuzz-hostile/). Run it with the worktree first on PYTHONPATH when the editable
install points elsewhere.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import hostile  # noqa: E402
from forked_cli import run_cli  # noqa: E402

BUDGET = float(os.environ.get("FUZZ_BUDGET", "30"))
SEED = int(os.environ.get("FUZZ_SEED", "1414"))


def run_case(case: hostile.Case, scratch: Path) -> tuple[object, list[str]]:
    """Run one case in a fresh folder under `scratch`; (the run, its failure classes)."""
    root = Path(tempfile.mkdtemp(dir=scratch, prefix=f"{case.kind}-"))
    try:
        folder = root / "d"
        argv = hostile.materialize(case, folder)
        before = hostile.snapshot(root)
        env = {k: v.replace("{d}", str(folder)) for k, v in case.env.items()}
        run = run_cli(argv, cwd=folder, timeout=case.timeout, env=env, send=case.send)
        return run, hostile.judge(case, run, root, folder, before)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def fuzz(bases: hostile.Bases, scratch: Path, seed: int, cases: int | None = None, budget: float | None = None,
         progress=None, kinds: list[str] | None = None) -> dict:
    """Run cases (each class first, then round-robin) until `cases` ran or `budget` seconds passed."""
    stats = {"codes": collections.Counter(), "failures": collections.Counter(), "kinds": collections.Counter(),
             "examples": [], "cases": 0, "seconds": 0.0}
    start = time.monotonic()
    for case in hostile.make_cases(bases, seed, kinds):
        if cases is not None and stats["cases"] >= cases:
            break
        if budget is not None and stats["cases"] >= len(hostile.GENERATORS) and time.monotonic() - start > budget:
            break
        run, failures = run_case(case, scratch)
        stats["cases"] += 1
        stats["kinds"][case.kind] += 1
        stats["codes"][run.code if run.code is not None else f"signal {run.signal}"] += 1
        for f in failures:
            stats["failures"][f] += 1
        if failures and len(stats["examples"]) < 50:
            stats["examples"].append(hostile.describe_failure(case, run, failures))
            if progress:  # at once: a long run cut short still shows what failed
                print(f"case {stats['cases']} FAILED: {stats['examples'][-1]}", file=progress, flush=True)
        if progress and stats["cases"] % 100 == 0:
            print(f"{stats['cases']} cases, {time.monotonic() - start:.0f} s, codes {dict(stats['codes'])}, "
                  f"failures {dict(stats['failures'])}", file=progress, flush=True)
    stats["seconds"] = time.monotonic() - start
    return stats


@pytest.fixture(scope="module")
def bases():
    return hostile.Bases()


def test_hostile_inputs_of_every_class(bases, tmp_path):
    stats = fuzz(bases, tmp_path, SEED, budget=BUDGET)
    assert set(stats["kinds"]) == set(hostile.GENERATORS), stats["kinds"]
    assert not stats["failures"], "\n".join(stats["examples"])


def main() -> None:
    parser = argparse.ArgumentParser(description="long fuzz run of the attnres-compile CLI on hostile files")
    parser.add_argument("--cases", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--out", help="write the counts as JSON here")
    parser.add_argument("--kinds", help=f"comma-separated classes (default all: {','.join(sorted(hostile.GENERATORS))})")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="attnres-fuzz-"))
    try:
        kinds = args.kinds.split(",") if args.kinds else None
        if kinds and set(kinds) - set(hostile.GENERATORS):
            parser.error(f"unknown --kinds {sorted(set(kinds) - set(hostile.GENERATORS))}")
        stats = fuzz(hostile.Bases(), scratch, args.seed, cases=args.cases, progress=sys.stdout, kinds=kinds)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = {"cases": stats["cases"], "seconds": round(stats["seconds"]), "seed": args.seed,
               "by_kind": dict(stats["kinds"]), "by_exit_code": {str(k): v for k, v in sorted(stats["codes"].items(), key=str)},
               "by_failure_class": {c: stats["failures"].get(c, 0) for c in hostile.FAILURE_CLASSES},
               "examples": stats["examples"]}
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
