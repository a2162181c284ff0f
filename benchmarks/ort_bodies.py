"""Side-by-side onnxruntime cost of two versions of the ONNX site form on the same rewritten models.

The two-phase grouping (onnx/two_phase.py) and the attnres function bodies
(onnx/function.py) decide what onnxruntime runs; the TVM backend never expands the
bodies. This builds `bench model`'s GPT-2 / Llama (width 256 or `--width`, seq 128, random weights), exports
the original and its Full and Block rewrites once, turns their sites back into one
DepthAttention node each, and gives them their final form twice: with this checkout's passes and
with those of another checkout of this layout (`--other`, e.g. `git worktree add /tmp/old REV`). Every session
runs at 1 thread; each round runs every session once, in turn, and the figure is the median over
rounds of (session / original - 1) in process CPU time, beside an identical copy of the original
and, as a second control, the other checkout's form twice.

--decode times one decode step instead (Llama's decoder with past, as `bench decode` exports it:
one new token over a KV cache of 128 positions). --split adds two Block sessions that say where a
Block site's time goes: every Merge's body replaced by its partial sum alone (the Partials still run:
onnxruntime keeps them) and by that sum plus its Gather of the Partial's state (the state reads);
their outputs are wrong on purpose, so only their time is read.
    python benchmarks/ort_bodies.py --other /tmp/old [--models gpt,llama] [--sublayers 48] [--width 256] [--rounds 60]
                                    [--decode] [--split]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attnres_compile.bench import timing  # noqa: E402
from attnres_compile.bench.model.measure import make_inputs, make_model, make_variants  # noqa: E402
from attnres_compile.bench.model.worker import onnxruntime_options  # noqa: E402
from attnres_compile.onnx import export as onnx_export, function as onnx_function, io as onnx_io  # noqa: E402
from attnres_compile.onnx import passes as onnx_passes, two_phase as onnx_grouping  # noqa: E402


def other_passes(checkout: Path):
    """The other checkout's ONNX passes (onnx/passes.py), its package loaded as `other_attnres`."""
    package = types.ModuleType("other_attnres")
    package.__path__ = [str(checkout / "attnres_compile")]
    sys.modules["other_attnres"] = package
    return importlib.import_module("other_attnres.onnx.passes")


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


def final_form(model: onnx.ModelProto, passes) -> bytes:
    model = onnx.ModelProto.FromString(model.SerializeToString())
    passes.run(model, [p() for p in passes.FINALIZE])
    return model.SerializeToString()


def ablated(model: bytes, state: bool) -> bytes:
    """`model` with every Merge's body its partial sum e0 (plus, with `state`, row `index` of the
    Partial's acc): the Block form less the Merges' own work (--split)."""
    proto = onnx.ModelProto.FromString(model)
    body = onnx_function.Body()
    if state:
        index = onnx_function._ref(body, "index", "index", onnx.AttributeProto.INT)
        body.op("Sum", ["e0", body.op("Gather", ["acc", index], "acc_i", axis=-2)], "output")
    else:
        body.op("Sum", ["e0"], "output")
    for fn in proto.functions:  # one per extra count; none where the form has no Merges (a short model)
        if fn.domain == onnx_function.DOMAIN and fn.name == onnx_function.MERGE:
            del fn.node[:]
            fn.node.extend(body.nodes)
    return proto.SerializeToString()


def decode_files(name: str, sublayers: int, width: int, folder: Path) -> tuple[dict[str, Path], dict]:
    """The decoder-with-past .onnx of each variant (as `bench decode` writes them) and the feeds of one
    step: one token after a KV cache of 128 positions."""
    from attnres_compile.bench.decode import measure as decode

    variants, geometry, args, spec = decode.make_variants(make_model(name, sublayers // 2, width, 192).model, 8)
    for v in variants:
        decode.save_files(v, args, spec, geometry["geometry"], folder, ["onnxruntime"])
    sess, past = session(str(variants[0].files["onnx"])), 128
    rng = np.random.default_rng(0)
    feeds = {"input_ids": np.array([[5]], np.int64), "attention_mask": np.ones((1, past + 1), np.int64),
             "position_ids": np.array([[past]], np.int64)}
    for i in sess.get_inputs():
        if i.name not in feeds:  # past key / value: [batch, heads, past, head_dim]
            feeds[i.name] = rng.standard_normal((1, i.shape[1], past, i.shape[3])).astype(np.float32)
    return {v.name: v.files["onnx"] for v in variants}, feeds


def session(model) -> ort.InferenceSession:
    return ort.InferenceSession(model, onnxruntime_options(1), providers=["CPUExecutionProvider"])


def compare(name: str, sublayers: int, width: int, other, rounds: int, folder: Path, decode: bool = False,
            split: bool = False) -> None:
    if decode:
        paths, feeds = decode_files(name, sublayers, width, folder)
    else:
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
        sessions[f"{variant}, this checkout"] = session(final_form(sites, onnx_passes))
        sessions[f"{variant}, --other"] = session(final_form(sites, other))
        sessions[f"{variant}, --other again"] = session(final_form(sites, other))
        if split and variant == "block":
            sessions["block, Partials only"] = session(ablated(final_form(sites, onnx_passes), state=False))
            sessions["block, + state reads"] = session(ablated(final_form(sites, onnx_passes), state=True))
    samples = timing.interleaved_clocks({k: (lambda s=s: s.run(None, feeds)) for k, s in sessions.items()},
                                        rounds, min_time=0)  # one run per session per round
    times = {k: clocks["cpu"] for k, clocks in samples.items()}
    what = "one decode step (past 128)" if decode else "forward (seq 128)"
    print(f"{name} {width}/{sublayers} {what}: original {1e3 * statistics.median(times['original']):.3f} ms CPU at "
          f"1 thread, median of {rounds} interleaved runs")
    for k, t in times.items():
        ratio = timing.paired_ratio(t, times["original"]) - 1
        print(f"  {k:24s} {1e3 * statistics.median(t):8.3f} ms  {100 * ratio:+6.1f}%", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", required=True, type=Path, help="another checkout of attnres-compile")
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--sublayers", default="48")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--decode", action="store_true", help="time one decode step over a KV cache (Llama)")
    parser.add_argument("--split", action="store_true", help="add the Block form less its Merges' work")
    args = parser.parse_args()
    other = other_passes(args.other)
    with tempfile.TemporaryDirectory(prefix="attnres-ort-bodies-") as tmp:
        for name in args.models.split(","):
            for sublayers in map(int, args.sublayers.split(",")):
                compare(name, sublayers, args.width, other, args.rounds, Path(tmp), args.decode, args.split)


if __name__ == "__main__":
    main()
