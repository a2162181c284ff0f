"""Side-by-side onnxruntime cost of two versions of the ONNX site form on the same rewritten models.

The two-phase grouping (passes/onnx_grouping.py) and the attnres function bodies
(passes/onnx_function.py) decide what onnxruntime runs; the TVM backend never expands the
bodies. This builds `bench model`'s GPT-2 / Llama (width 256 or `--width`, seq 128, random weights), exports
the original and its Full and Block rewrites once, turns their sites back into one
DepthAttention node each, and gives them their final form twice: with this checkout's passes and
with those of another checkout (`--other`, e.g. `git worktree add /tmp/old REV`). Every session
runs at 1 thread; each round runs every session once, in turn, and the figure is the median over
rounds of (session / original - 1) in process CPU time, beside an identical copy of the original
and, as a second control, the other checkout's form twice.
    python benchmarks/ort_bodies.py --other /tmp/old [--models gpt,llama] [--sublayers 48] [--width 256] [--rounds 60]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import types
from pathlib import Path

import onnx
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attnres_compile.bench import timing  # noqa: E402
from attnres_compile.bench.model import make_inputs, make_model, make_variants  # noqa: E402
from attnres_compile.bench.model_worker import onnxruntime_options  # noqa: E402
from attnres_compile.passes import onnx_export, onnx_function, onnx_grouping, onnx_io  # noqa: E402


def other_passes(checkout: Path):
    """The other checkout's onnx_function and onnx_grouping, loaded as the package `other_passes`."""
    package = types.ModuleType("other_passes")
    package.__path__ = [str(checkout / "attnres_compile" / "passes")]
    sys.modules["other_passes"] = package
    return importlib.import_module("other_passes.onnx_grouping")


def one_node_per_site(path: Path) -> onnx.ModelProto:
    """The rewritten model at `path` with every site one DepthAttention node over its sources, no Partials."""
    model = onnx.load(str(path))
    found = {id(s.node): s for s in onnx_grouping.sites(model.graph)}
    nodes = [onnx_function.site_node(s.sources, s.query, s.node.output[0], eps=s.eps, scale=s.scale, axis=s.axis,
                                     rank=3, name=s.node.name) if (s := found.get(id(n))) else n
             for n in model.graph.node if not (n.domain == onnx_function.DOMAIN and n.op_type == onnx_function.PARTIAL)]
    model.graph.ClearField("node")
    model.graph.node.extend(nodes)
    return model


def final_form(model: onnx.ModelProto, grouping) -> bytes:
    model = onnx.ModelProto.FromString(model.SerializeToString())
    grouping.finalize_sites(model)
    return model.SerializeToString()


def session(model) -> ort.InferenceSession:
    return ort.InferenceSession(model, onnxruntime_options(1), providers=["CPUExecutionProvider"])


def compare(name: str, sublayers: int, width: int, other, rounds: int, folder: Path) -> None:
    model = make_model(name, sublayers // 2, width, 128)
    feeds = make_inputs(1, 128)
    args = tuple(torch.from_numpy(v) for v in feeds.values())
    paths = {}
    for v in make_variants(model, args, 8):
        paths[v.name] = folder / f"{name}{sublayers}_{v.name}.onnx"
        onnx_io.write(onnx_export.export(v.program.module(), args), paths[v.name])
    sessions = {"original": session(str(paths["original"])), "copy": session(str(paths["original"]))}
    for variant in ("block", "full"):
        sites = one_node_per_site(paths[variant])
        sessions[f"{variant}, this checkout"] = session(final_form(sites, onnx_grouping))
        sessions[f"{variant}, --other"] = session(final_form(sites, other))
        sessions[f"{variant}, --other again"] = session(final_form(sites, other))
    samples = timing.interleaved_clocks({k: (lambda s=s: s.run(None, feeds)) for k, s in sessions.items()},
                                        rounds, min_time=0)  # one run per session per round
    times = {k: clocks["cpu"] for k, clocks in samples.items()}
    print(f"{name} {width}/{sublayers}: original {1e3 * statistics.median(times['original']):.2f} ms CPU at 1 thread, "
          f"median of {rounds} interleaved runs")
    for k, t in times.items():
        ratio = timing.paired_ratio(t, times["original"]) - 1
        print(f"  {k:24s} {1e3 * statistics.median(t):8.2f} ms  {100 * ratio:+6.1f}%", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", required=True, type=Path, help="another checkout of attnres-compile")
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--sublayers", default="48")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    other = other_passes(args.other)
    with tempfile.TemporaryDirectory(prefix="attnres-ort-bodies-") as tmp:
        for name in args.models.split(","):
            for sublayers in map(int, args.sublayers.split(",")):
                compare(name, sublayers, args.width, other, args.rounds, Path(tmp))


if __name__ == "__main__":
    main()
