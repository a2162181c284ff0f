"""What crosses each pipeline hop of a rewritten HF Llama, without and with the rank-local cache.

A tiny Llama (16 layers, width 64, 4 heads, float32; one sequence of 32 tokens) rewritten to
Block N=4, Block N=8 and Full, split by `split_stages` into P × V stages (P ranks, V stages per
rank), with `stage_ranks` of Interleaved1F1B (loop: stage s on rank s mod P) and of ZBV (V:
rank r holds r and 2P − 1 − r). Per hop: the history tensors, then bytes per token without the
cache, with the loop cache and with the V cache ("local": both stages on one rank, nothing is
sent), and Megatron-LM's payload for the same boundary (PR #6840, `attention_residual.py`:
`attn_res_num_payload_slices` without the cache, `attn_res_boundary_delta_slices` with it; slices
of d values, float32, Block only: `attn_res_block_layers` = 16 / N layers per block).

    python benchmarks/pipeline_hops.py --ranks 4 --per-rank 2 [--json hops.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers as tf  # noqa: E402

from attnres_compile import AttnResConfig, rewrite  # noqa: E402
from attnres_compile.distributed import schedule_stage_ranks, split_stages  # noqa: E402

LAYERS, WIDTH, TOKENS = 16, 64, 32


def llama():
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=100, max_position_embeddings=TOKENS)
    ids = torch.randint(0, 100, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    return tf.LlamaForCausalLM(cfg).eval(), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}


def megatron_slices(stage: int, layers_per_stage: int, block_layers: int, pp: int, cached: bool) -> int:
    """Megatron-LM's slices into `stage` (loop placement): the sources formed so far plus the
    partial sum, or with the cache only those formed since the receiver's previous chunk."""
    def formed(n: int) -> int:  # _sources_formed_through: floor((n - 1) / k) + 1 sources after n layers
        return 0 if n <= 0 else (n - 1) // block_layers + 1
    full = formed(stage * layers_per_stage)
    known = formed((stage - pp + 1) * layers_per_stage) if cached and stage >= pp else 0
    return full - known + 1


def hops(variant: str, blocks: int | None, pp: int, per_rank: int) -> list[dict]:
    model, inputs = llama()
    gm = rewrite(model, inputs, AttnResConfig(variant=variant, num_blocks=blocks)).graph_module
    count = pp * per_rank
    plans = {name: split_stages(gm, (), inputs, num_stages=count, max_carried=64,
                                stage_ranks=schedule_stage_ranks(name, pp, count))[1]
             for name in ("Interleaved1F1B", "ZBVZeroBubble")}
    loop, v = plans["Interleaved1F1B"], plans["ZBVZeroBubble"]
    rows = []
    for h, (a, b) in enumerate(zip(loop.hops, v.hops)):
        row = {"hop": f"{h}->{h + 1}", "history": sum(x.kind == "history" for x in a.values),
               "bytes_per_token": a.bytes / loop.tokens,
               "loop": a.sent_bytes / loop.tokens, "loop_cached": [x.name for x in a.values if x.cached],
               "v": None if v.stage_ranks[h] == v.stage_ranks[h + 1] else b.sent_bytes / v.tokens,
               "v_cached": [x.name for x in b.values if x.cached]}
        if variant == "block":
            k = LAYERS // blocks
            row["megatron"] = megatron_slices(h + 1, LAYERS // count, k, pp, False) * WIDTH * 4
            row["megatron_cached"] = megatron_slices(h + 1, LAYERS // count, k, pp, True) * WIDTH * 4
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--per-rank", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    out = {f"{variant} {blocks or ''}".strip(): hops(variant, blocks, args.ranks, args.per_rank)
           for variant, blocks in (("block", 4), ("block", 8), ("full", None))}
    for name, rows in out.items():
        print(f"{name}: P={args.ranks}, V={args.per_rank}; bytes per token")
        print(f"{'hop':>5} {'history':>8} {'no cache':>9} {'loop':>7} {'V':>7} {'Megatron':>9} {'Megatron cached':>16}")
        for r in rows:
            v = "local" if r["v"] is None else round(r["v"])
            print(f"{r['hop']:>5} {r['history']:>8} {round(r['bytes_per_token']):>9} {round(r['loop']):>7} {v:>7} "
                  f"{r.get('megatron', '-'):>9} {r.get('megatron_cached', '-'):>16}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
