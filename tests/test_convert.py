"""`ac.convert`: a converted HF causal LM that lives through the usual fine-tuning workflow.

On a tiny Llama and a tiny GPT-2 (from configs): the module tree is the user's, PEFT LoRA after
conversion trains with the function unchanged at init, HF Trainer runs 3 steps without wrappers,
a bf16-cast and a bf16-autocast step train, gradient checkpointing recomputes the layers,
`save_pretrained` -> a fresh process's `from_pretrained(trust_remote_code=True)` gives bitwise
equal logits and the same next training step, with queries planted non-zero before saving (a route
that drops them gives other logits); bad folders fail in one line.
"""

from __future__ import annotations

import copy
import functools
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf

import attnres_compile as ac
from attnres_compile.core.errors import InputError

ROOT = Path(__file__).parents[1]
CONFIG = ac.AttnResConfig(variant="block", num_blocks=2)
TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}


def _config(arch: str):
    if arch == "llama":
        return tf.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1)
    return tf.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=1,
                         eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


@functools.cache
def _pair(arch: str):
    torch.manual_seed(0)
    original = tf.AutoModelForCausalLM.from_config(_config(arch)).eval()
    return arch, original, ac.convert(original, CONFIG)


@pytest.fixture(params=["llama", "gpt2"])
def pair(request):
    """(arch, original, converted): converted once per architecture for the whole file."""
    return _pair(request.param)


def _ids(seed: int = 0, shape=(2, 9)) -> torch.Tensor:
    return torch.randint(3, 100, shape, generator=torch.Generator().manual_seed(seed))


def _plant(model, seed: int = 1) -> None:
    """Non-zero queries: a route that drops them computes something else."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "attnres" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 2)


def test_the_module_tree_is_the_users(pair):
    arch, original, converted = pair
    assert isinstance(converted, type(original)) and type(converted).__name__ == "AttnRes" + type(original).__name__
    theirs = {n: type(m) for n, m in original.named_modules()}
    ours = {n: type(m) for n, m in converted.named_modules() if "attnres" not in n}
    assert ours.keys() == theirs.keys()
    assert all(issubclass(ours[n], theirs[n]) for n in theirs)
    leaves = [n for n, m in original.named_modules() if not list(m.children())]
    assert all(ours[n] is theirs[n] for n in leaves)  # nn.Linear, Conv1D, norms, embeddings: the same classes
    queries = [n for n, _ in converted.named_parameters() if "attnres" in n]
    assert len(queries) == 4 and all(n.split(".")[-1].startswith("site") for n in queries)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, original(ids).logits, rtol=1e-5, atol=1e-5)
    args = dict(attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert torch.equal(converted.generate(ids, **args), original.generate(ids, **args))


def test_deepcopy_and_torch_save(pair):
    _, _, converted = pair
    ids = _ids()
    with torch.no_grad():
        want = converted(ids).logits
        assert torch.equal(copy.deepcopy(converted)(ids).logits, want)
        buffer = io.BytesIO()
        torch.save(converted, buffer)
        buffer.seek(0)
        assert torch.equal(torch.load(buffer, weights_only=False)(ids).logits, want)


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        ids = _ids(100 + i, (9,))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def test_peft_lora_after_conversion_and_trainer(pair, tmp_path):
    from peft import LoraConfig, get_peft_model

    arch, _, converted = pair
    model = copy.deepcopy(converted)
    ids = _ids()
    with torch.no_grad():
        want = model(ids).logits
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=TARGETS[arch], modules_to_save=["attnres"]))
    with torch.no_grad():
        assert torch.equal(lora(input_ids=ids).logits, want)  # LoRA starts at zero: the function is unchanged
    before = {n: p.detach().clone() for n, p in lora.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in before) and any("attnres" in n for n in before)
    args = tf.TrainingArguments(str(tmp_path), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2,
                                report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, disable_tqdm=True)
    trainer = tf.Trainer(model=lora, args=args, train_dataset=_Tokens())
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    moved = {n for n, p in lora.named_parameters() if n in before and not torch.equal(p, before[n])}
    assert any("lora_B" in n for n in moved) and any("attnres" in n for n in moved)


def _step(model, ids, dtype=None, autocast=False) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(ids, labels=ids).loss
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "attnres" in n]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    opt.step()
    return loss.item()


def test_bf16_autocast_and_cast_steps(pair):
    arch, original, converted = pair
    ids = _ids()
    want = _step(copy.deepcopy(original).train(), ids, autocast=True)
    got = _step(copy.deepcopy(converted).train(), ids, autocast=True)
    assert abs(got - want) < 2e-2 * abs(want)  # bf16 matmuls; the sites sum in float32 as `+` in float32 would
    cast = copy.deepcopy(converted).to(torch.bfloat16).train()
    assert abs(_step(cast, ids) - _step(copy.deepcopy(original).to(torch.bfloat16).train(), ids)) < 5e-2 * abs(want)
    if arch == "llama":  # converted in float32 then cast is converted in bfloat16, bit for bit
        native = ac.convert(copy.deepcopy(original).to(torch.bfloat16), CONFIG)
        with torch.no_grad():
            cast16 = copy.deepcopy(converted).to(torch.bfloat16)
            assert torch.equal(cast16(ids).logits, native(ids).logits)


def test_gradient_checkpointing_recomputes_the_layers(pair):
    arch, _, converted = pair
    ids = _ids()
    plain, checkpointed = copy.deepcopy(converted).train(), copy.deepcopy(converted).train()
    checkpointed.gradient_checkpointing_enable()
    calls = []
    leaf = TARGETS[arch][0]
    for name, module in checkpointed.named_modules():
        if name.endswith(leaf):
            module.register_forward_hook(lambda *a: calls.append(1))
    losses = []
    for model in (plain, checkpointed):
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    assert len(calls) == 4  # 2 layers, each run again in the backward
    assert torch.equal(losses[0], losses[1])
    for (n, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=n)


FRESH = r"""
import json, sys, torch, importlib.abc
import transformers as tf
folder = sys.argv[1]
class Missing(importlib.abc.MetaPathFinder):  # attnres-compile not installed
    def find_spec(self, name, path, target=None):
        if name == "attnres_compile" or name.startswith("attnres_compile."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Missing())
try:
    tf.AutoModelForCausalLM.from_pretrained(folder + "/llama", trust_remote_code=True)
    print("LOADED WITHOUT THE PACKAGE")
except ImportError as exc:
    print("missing:", str(exc).splitlines()[0])
sys.meta_path.pop(0)
result = {}
for arch in ("llama", "gpt2"):
    model = tf.AutoModelForCausalLM.from_pretrained(f"{folder}/{arch}", trust_remote_code=True)
    ids, want = torch.load(f"{folder}/{arch}.pt")
    with torch.no_grad():
        equal = torch.equal(model(ids).logits, want)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    torch.save({n: p.detach() for n, p in model.named_parameters()}, f"{folder}/{arch}.step.pt")
    result[arch] = {"class": type(model).__name__, "equal": equal, "loss": loss.item()}
print(json.dumps(result))
"""


def test_save_pretrained_then_a_fresh_process_loads_it_bitwise(tmp_path):
    saved = {}
    for arch in ("llama", "gpt2"):
        model = copy.deepcopy(_pair(arch)[2])
        _plant(model)
        ids = _ids(3)
        with torch.no_grad():
            want = model(ids).logits
        model.save_pretrained(tmp_path / arch)
        torch.save((ids, want), tmp_path / f"{arch}.pt")
        files = set(os.listdir(tmp_path / arch))
        assert {"config.json", "model.safetensors", "modeling_attnres.py", "attnres_graph.float32.json"} <= files
        loaded = ac.load(tmp_path / arch)  # without trust_remote_code
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, want)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        saved[arch] = (loss.item(), {n: p.detach().clone() for n, p in model.named_parameters()})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", FRESH, str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "missing: this checkpoint is an AttnRes model converted by attnres-compile: pip install attnres-compile"
    result = json.loads(lines[-1])
    for arch, (loss, params) in saved.items():
        assert result[arch]["class"].startswith("AttnRes") and result[arch]["equal"], result
        assert result[arch]["loss"] == loss  # the same training step: same loss, same weights after
        stepped = torch.load(tmp_path / f"{arch}.step.pt")
        assert stepped.keys() == params.keys()
        assert all(torch.equal(stepped[n], params[n]) for n in params)


def test_bad_folders_fail_in_one_line(tmp_path):
    _, original, converted = _pair("llama")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="neither a Hugging Face checkpoint nor an AttnRes one"):
        ac.load(empty)
    original.save_pretrained(tmp_path / "plain")
    with pytest.raises(InputError, match="is a Hugging Face checkpoint, not an AttnRes one"):
        ac.load(tmp_path / "plain")
    converted.save_pretrained(tmp_path / "newer")
    config = json.loads((tmp_path / "newer" / "config.json").read_text())
    config["attnres"]["format"] = 99
    (tmp_path / "newer" / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=r"newer attnres-compile \(format 99.*pip install -U attnres-compile"):
        ac.load(tmp_path / "newer")
    converted.save_pretrained(tmp_path / "edited")
    config = json.loads((tmp_path / "edited" / "config.json").read_text())
    config["num_hidden_layers"] = 1  # the plan's graph calls layer 1, which this architecture lacks
    (tmp_path / "edited" / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="site plan does not match its base architecture") as caught:
        ac.load(tmp_path / "edited")
    assert len(str(caught.value).splitlines()) == 1


def test_any_module_converts_with_its_example():
    """Not only HF: a plain nn.Module is converted on its example inputs, keeps its modules (LoRA fits),
    and trains; its blocks are called modules."""
    from peft import LoraConfig, get_peft_model

    from samples.models import gpt_factory

    model, inputs = gpt_factory(layers=2)
    model.eval()
    converted = ac.convert(model, ac.AttnResConfig(variant="full"), inputs)
    assert isinstance(converted, type(model)) and type(converted.blocks[0]).__name__ == "AttnRes" + type(model.blocks[0]).__name__
    tokens = torch.randint(0, 96, (3, 20))
    with torch.no_grad():
        torch.testing.assert_close(converted(tokens), model(tokens), rtol=1e-5, atol=1e-5)
    lora = get_peft_model(converted, LoraConfig(r=2, target_modules=["qkv"]))
    for name, p in lora.named_parameters():
        p.requires_grad_("lora_" in name or "attnres" in name)
    lora.train()
    lora(tokens).square().mean().backward()
    grads = {n: p.grad for n, p in lora.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values()) and any("attnres" in n for n in grads)


def test_a_mixture_of_experts_converts():
    """Mixtral's experts run transformers' grouped_mm custom op by default, which the graph data may
    not name: the trace switches them to batched_mm (fx/hf_experts.py), as the ONNX route does."""
    from samples.hf_decoders import mixtral_factory

    model, inputs = mixtral_factory()
    converted = ac.convert(model, CONFIG)
    with torch.no_grad():
        torch.testing.assert_close(converted(input_ids=inputs["input_ids"], use_cache=False).logits,
                                   model(input_ids=inputs["input_ids"], use_cache=False).logits, rtol=1e-5, atol=1e-5)
    assert model.get_experts_implementation() == converted.get_experts_implementation()  # switched back


def test_opt_converts_and_generates():
    """OPT: its MLP reads [batch x tokens, width] (the sites' sources are brought to one layout by an
    aten.reshape_as the graph data can name) and its positions module takes the mask and position ids
    (not outlined as a one-input module: the traced input came in through the second)."""
    from samples.hf_decoders import decoder

    model, inputs = decoder(tf.OPTConfig, tf.OPTForCausalLM, ffn_dim=64, word_embed_proj_dim=32, pad_token_id=0,
                            bos_token_id=1, eos_token_id=2)
    converted = ac.convert(model, CONFIG)
    ids = inputs["input_ids"][:1, :6]
    assert torch.equal(converted.generate(ids, max_new_tokens=8, do_sample=False),
                       model.generate(ids, max_new_tokens=8, do_sample=False))


def test_trained_queries_reach_pt2(tmp_path, capsys):
    """A converted model with planted queries exported with `ac.export_pt2`: the archive generates the model's own
    greedy tokens, which differ from the untrained conversion's (the ONNX route: tests/test_readme.py's loop)."""
    from attnres_compile.cli.program import main

    _, original, converted = _pair("llama")
    trained = copy.deepcopy(converted)
    _plant(trained)
    prompt = torch.tensor([[5, 17, 42, 8]])
    args = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    want = trained.generate(prompt, **args)[0, 4:].tolist()
    assert want != converted.generate(prompt, **args)[0, 4:].tolist()
    ac.export_pt2(trained, None, tmp_path / "m.pt2", with_past=True, verify_outputs=False)  # the tokens check it
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "m.pt2"), "--prompt-ids", "5,17,42,8", "--max-new-tokens", "8",
                 "--ignore-eos"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[0] == ",".join(map(str, want))


def test_graph_data_runs_no_code():
    """A saved graph is data: call targets are arithmetic, torch.sym_* or compute-only torch ops. An
    `operator.call` / `methodcaller` chain (x.numpy().tofile(path)) or an aten op that does I/O is refused
    before anything runs, in one line."""
    from attnres_compile.hf.program import GraphDataError, from_data

    def graph(target, *args):
        return {"nodes": [{"op": "placeholder", "target": "x", "name": "x"},
                          {"op": "call_function", "target": target, "args": [{"n": "x"}, *args], "name": "y"},
                          {"op": "output", "target": "output", "args": [{"n": "y"}], "name": "output"}]}

    assert from_data(graph("operator:add", 1))[0] is not None
    for target in ("operator:call", "operator:methodcaller", "operator:attrgetter", "op:aten::save.default",
                   "op:aten::from_file.default", "op:os::system.default", "builtins:eval"):
        with pytest.raises(GraphDataError, match="is not one this reader allows"):
            from_data(graph(target, "/tmp/written-by-a-graph"))
