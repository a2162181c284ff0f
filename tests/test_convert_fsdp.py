"""A converted tiny Llama trains under FSDP2 with bf16 mixed precision (`MixedPrecisionPolicy(
param_dtype=bfloat16, reduce_dtype=float32)`, `fully_shard` per decoder layer and on the root) on 2
gloo ranks as it does in one process, within bf16 tolerance: the same losses step by step and the
same trained pseudo-queries. The ranks really compute in bf16 (the model's bf16 graph is traced on
the first sharded forward) and load the converted model from its `save_pretrained` folder.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers as tf

import attnres_compile as ac

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")
STEPS, WORLD, LR = 3, 2, 1.0


def _batches() -> list[torch.Tensor]:
    return list(torch.randint(3, 100, (STEPS, 2 * WORLD, 12), generator=torch.Generator().manual_seed(2)))


def _train(model, opt, batches, shard) -> list[float]:
    losses = []
    for ids in batches:
        loss = model(input_ids=shard(ids), labels=shard(ids)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss = loss.detach().float()
        if dist.is_initialized():
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return losses


def _queries(model) -> dict[str, list[float]]:
    out = {}
    for name, p in model.named_parameters():
        if "attnres" in name:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = full.detach().float().tolist()
    return out


def _worker(rank: int, folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=WORLD)
    try:
        model = ac.load(f"{folder}/ckpt").train()
        mesh = init_device_mesh("cpu", (WORLD,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses = _train(model, opt, _batches(), lambda t: t.chunk(WORLD)[rank])
        result = {"losses": losses, "queries": _queries(model),
                  "graphs": sorted(model.get_decoder().attnres_state.programs),
                  "params": sorted({str(p.dtype) for p in model.parameters()})}
        if rank == 0:
            Path(folder, "result.json").write_text(json.dumps(result))
        del model, opt
        gc.collect()  # FSDP2 state sits in reference cycles: freed while gloo is alive
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_fsdp2_bf16_mixed_precision_matches_one_process(tmp_path):
    import torch.multiprocessing as mp

    config = tf.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                            num_attention_heads=2, num_key_value_heads=1)  # 4: traced as 3 and grown, bf16 too
    torch.manual_seed(0)
    ac.convert(tf.LlamaForCausalLM(config).eval(), ac.AttnResConfig(variant="block", num_blocks=2)).save_pretrained(
        tmp_path / "ckpt")
    reference = ac.load(tmp_path / "ckpt").train()  # one process, float32, the whole batch
    losses = _train(reference, torch.optim.SGD(reference.parameters(), lr=LR), _batches(), lambda t: t)
    queries = _queries(reference)
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=WORLD)
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["graphs"] == ["bfloat16", "float32"] and got["params"] == ["torch.float32"]  # bf16 compute, fp32 master
    assert got["losses"] == pytest.approx(losses, rel=1e-2)
    assert got["queries"].keys() == queries.keys() and len(queries) == 8
    moved = max(abs(v) for q in queries.values() for v in q)
    error = max(abs(a - b) for name, q in queries.items() for a, b in zip(got["queries"][name], q))
    print(f"queries moved up to {moved:.3e}; FSDP2 bf16 vs one process: max abs difference {error:.3e}; losses "
          f"{got['losses']} vs {losses}")
    # SGD: an update is its gradient, bf16 rounding and all: 3.7% of the movement at 4 layers (the same to the
    # bit when the conversion traces the model whole), under 2% at 2 layers
    assert moved > 0.05 and error <= 0.05 * moved
