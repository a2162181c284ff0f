"""What the next norm costs a site, before and after fusing them (ops/site_norm.py, fx/site_norm.py).

For a site over S sources of [B, T, D] (float32) read by the next sublayer's norm, in eager torch:
  site       torch.ops.attnres.depth_attention alone (the fused TVM kernel, as a rewritten model runs it)
  site_copy  the same call again: the identical-copy control (how far two readings of one thing differ)
  unfused    the site, then the norm as the model runs it: HF Llama's RMSNorm (pow, mean, add, rsqrt,
             mul, mul by the weight) or aten.layer_norm with weight and bias (GPT-2)
  fused      torch.ops.attnres.depth_attention_norm: (mixed, normed) from one kernel
each forward only and forward + backward (autograd from the normed output's gradient; the site's
sources, query and the norm's weight and bias require gradients). The norm's share of the site's
cost is (unfused - site) / unfused before, (fused - site) / fused after; `fused / unfused` is the
paired ratio of the two with its interval (bench/timing.py: interleaved rounds, the median of the
per-round ratios). Headline clock: 1-thread process CPU time; 2-thread wall time beside it.

Bytes per site (the roofline of these memory-bound calls, float32): the site reads S sources and
writes its output, (S + 1) rows*D*4; a separate norm reads that output and writes the normed one,
+2 (HF's decomposed RMSNorm moves more: each of its elementwise ops is a pass); the fused pair
writes both outputs from one read of the sources, S + 2. Backward: the site reads S sources and
g and writes S gradients (2S + 1); the norm's backward reads its input and gradient and writes
one, +3; the fused backward recomputes the mixed row in cache and reads only the normed output's
gradient, 2S + 1.

`--models`: whole models instead, HF Llama (RMSNorm) and GPT-2 (LayerNorm) from configs of width
256 and 12 layers (24 sublayers), rewritten to Block N=8, batch 1, 128 tokens, in eager torch at
1 thread: the rewritten module (`rewritten`, twice: `rewritten_copy` is the control) against the
same module after `fuse_norms` (`fused`), forward under no_grad and forward + backward.

    python benchmarks/bench_site_norm.py [--sources 5] [--rounds 7] [--models] [--out FOLDER]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import attnres_compile  # noqa: F401  (registers the ops)
from attnres_compile.bench.timing import interleaved_clocks, paired_ratio, ratio_interval

SHAPES = {"decode": (1, 1), "T=128": (1, 128)}  # (B, T)
WIDTHS = (256, 1024)
NORMS = ("rms", "layer")


def hf_rms(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm.forward on a float32 tensor, op by op."""
    h = h.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    return weight * (h * torch.rsqrt(variance + eps)).to(torch.float32)


def candidates(kind: str, count: int, batch: int, length: int, width: int, train: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(batch, length, width, generator=g).requires_grad_(train) for _ in range(count)]
    query = (torch.randn(width, generator=g) / width**0.5).requires_grad_(train)
    weight = torch.randn(width, generator=g).requires_grad_(train)
    bias = torch.randn(width, generator=g).requires_grad_(train) if kind == "layer" else None
    grad = torch.randn(batch, length, width, generator=g)
    site = torch.ops.attnres.depth_attention.default
    pair = torch.ops.attnres.depth_attention_norm.default
    eps = 1e-5

    def norm(h):
        return hf_rms(h, weight, eps) if kind == "rms" else torch.nn.functional.layer_norm(h, (width,), weight, bias, eps)

    def run(out):
        if train:
            torch.autograd.backward(out, grad)

    def site_only():
        run(site(sources, query, 1e-6, float(count), -1))

    def unfused():
        run(norm(site(sources, query, 1e-6, float(count), -1)))

    def fused():
        run(pair(sources, query, 1e-6, float(count), -1, weight, bias, eps, kind)[1])

    with torch.no_grad():  # the two forms agree before they are timed
        want = norm(site(sources, query, 1e-6, float(count), -1))
        got = pair(sources, query, 1e-6, float(count), -1, weight, bias, eps, kind)[1]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    return {"site": site_only, "site_copy": site_only, "unfused": unfused, "fused": fused}


def site_bytes(count: int, rows: int, width: int, train: bool) -> dict:
    unit = rows * width * 4
    if train:
        return {"site": (3 * count + 2) * unit, "unfused": (3 * count + 2 + 5) * unit, "fused": (3 * count + 3) * unit}
    return {"site": (count + 1) * unit, "unfused": (count + 3) * unit, "fused": (count + 2) * unit}


def measure(args) -> list[dict]:
    rows = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        clock = "cpu" if threads == 1 else "wall"
        for width in WIDTHS:
            for shape, (batch, length) in SHAPES.items():
                for kind in NORMS:
                    for train in (False, True):
                        fns = candidates(kind, args.sources, batch, length, width, train)
                        samples = interleaved_clocks(fns, rounds=args.rounds, min_time=args.min_time)
                        ms = {name: statistics.median(s[clock]) * 1e3 for name, s in samples.items()}
                        low, high, cover = ratio_interval(samples["fused"][clock], samples["unfused"][clock])
                        copy = paired_ratio(samples["site_copy"][clock], samples["site"][clock])
                        rows.append({
                            "threads": threads, "clock": clock, "width": width, "shape": shape, "norm": kind,
                            "pass": "forward+backward" if train else "forward", "sources": args.sources,
                            "ms": ms, "norm_share_before": (ms["unfused"] - ms["site"]) / ms["unfused"],
                            "norm_share_after": (ms["fused"] - ms["site"]) / ms["fused"],
                            "fused_over_unfused": paired_ratio(samples["fused"][clock], samples["unfused"][clock]),
                            "interval": [low, high, cover], "copy_over_site": copy,
                            "bytes": site_bytes(args.sources, batch * length, width, train),
                        })
                        print(_line(rows[-1]), flush=True)
    return rows


def model_candidates(name: str, train: bool) -> dict:
    import copy

    import transformers as tf

    import attnres_compile as ac

    torch.manual_seed(0)
    if name == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=12, hidden_size=256, intermediate_size=688,
                                                   num_attention_heads=4, num_key_value_heads=4, vocab_size=1000))
    else:
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=12, n_embd=256, n_head=4, vocab_size=1000, n_positions=256,
                                                 bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 1000, (1, 128))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    gm = ac.rewrite(model.eval(), inputs, ac.AttnResConfig(variant="block", num_blocks=8), verify_outputs=False).graph_module
    fused = ac.fuse_norms(copy.deepcopy(gm)).graph_module
    params = [p for m in (gm, fused) for p in m.parameters()]
    for p in params:
        p.requires_grad_(train)

    def run(module):
        def call():
            if train:
                module(**inputs).logits.square().mean().backward()
            else:
                with torch.no_grad():
                    module(**inputs)
        return call

    with torch.no_grad():
        want, got = gm(**inputs).logits, fused(**inputs).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    return {"rewritten": run(gm), "rewritten_copy": run(gm), "fused": run(fused)}


def measure_models(args) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    for name in ("llama", "gpt2"):
        for train in (False, True):
            samples = interleaved_clocks(model_candidates(name, train), rounds=args.rounds, min_time=args.min_time)
            ms = {k: statistics.median(v["cpu"]) * 1e3 for k, v in samples.items()}
            low, high, cover = ratio_interval(samples["fused"]["cpu"], samples["rewritten"]["cpu"])
            rows.append({"model": name, "pass": "forward+backward" if train else "forward", "ms": ms,
                         "fused_over_rewritten": paired_ratio(samples["fused"]["cpu"], samples["rewritten"]["cpu"]),
                         "interval": [low, high, cover],
                         "copy_over_rewritten": paired_ratio(samples["rewritten_copy"]["cpu"], samples["rewritten"]["cpu"])})
            r = rows[-1]
            print(f"{name:5s} {r['pass']:16s} rewritten {ms['rewritten']:8.2f} ms (copy x{r['copy_over_rewritten']:.3f})  "
                  f"fused {ms['fused']:8.2f} ms  x{r['fused_over_rewritten']:.3f} ({low:.3f}..{high:.3f}, {cover:.0%})",
                  flush=True)
    return rows


def _line(r: dict) -> str:
    ms, b = r["ms"], r["bytes"]
    low, high, _ = r["interval"]
    return (f"{r['threads']}t {r['clock']:4s} D={r['width']:4d} {r['shape']:6s} {r['norm']:5s} {r['pass']:16s} "
            f"site {ms['site']*1e3:7.1f} us (copy x{r['copy_over_site']:.3f})  unfused {ms['unfused']*1e3:7.1f}  "
            f"fused {ms['fused']*1e3:7.1f}  norm share {r['norm_share_before']:6.1%} -> {r['norm_share_after']:6.1%}  "
            f"fused/unfused x{r['fused_over_unfused']:.3f} ({low:.3f}..{high:.3f})  "
            f"bytes site/unfused/fused {b['site']/1024:.0f}/{b['unfused']/1024:.0f}/{b['fused']/1024:.0f} KiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--min-time", type=float, default=0.1)
    parser.add_argument("--models", action="store_true", help="whole models instead of one site")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    started = time.time()
    rows = measure_models(args) if args.models else measure(args)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"argv": sys.argv, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
                "seconds": round(time.time() - started)}
        stem = "models" if args.models else "site_norm"
        (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        if not args.models:
            (args.out / "site_norm.txt").write_text("\n".join(map(_line, rows)) + "\n")


if __name__ == "__main__":
    main()
