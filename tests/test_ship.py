"""Ship what you trained: a converted tiny Llama with planted non-zero queries, saved with
`save_pretrained`, deployed by every route, each giving the trained model's own greedy tokens
(`generate()` in PyTorch), which differ from the untrained conversion's (so a route that drops
the queries fails here):

- `rewrite CKPT -o X.onnx --with-past` (a saved AttnRes checkpoint: its queries, no second
  conversion; four alike layers, so exported as three and grown) -> `generate X.onnx`, then
  `compile X.onnx` (TVM) -> `generate ARTIFACT`;
- `rewrite CKPT -o X.pt2 --with-past` -> `generate X.pt2`, and plain `torch.export.load` of it in a
  fresh process gives the trained model's logits;
- onnxruntime-genai: the base model's folder (onnxruntime-genai's builder) rewritten with
  `--queries CKPT` -> `generate FOLDER`; the base folder's own tokens are the untrained conversion's;
- bad input in one line: a folder that is neither checkpoint, a newer format, a site plan for
  another architecture, AttnRes options other than the checkpoint's, queries that do not fit.

The tiny model is sized for the builder (head size 32: onnxruntime's CPU GroupQueryAttention;
intermediate size != vocabulary: the builder takes any Linear with `vocab_size` outputs for the
head).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf

import attnres_compile as ac
from attnres_compile.cli.program import main
from attnres_compile.core.errors import InputError

ROOT = Path(__file__).parents[1]
PROMPT = [5, 17, 42, 8]
NEW = 8
BUILD = """import sys
from onnxruntime_genai.models import builder
hf, out = sys.argv[1:]
args = ("", hf, out, "fp32", "cpu", out + "_cache")
builder.create_model(*args, **builder.parse_extra_options(*args, {}))
"""
FRESH = r"""
import sys, torch
program = torch.export.load(sys.argv[1])          # plain torch: the ops register through torch's entry point
ids, past, want = torch.load(sys.argv[2])
out = program.module()(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None], *past)
print("EQUAL" if torch.allclose(out[0], want, rtol=1e-5, atol=1e-5) else f"DIFF {(out[0] - want).abs().max()}")
"""


def _tokenizer(folder: Path, vocab: int) -> None:
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(folder)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """{folder, base, ckpt, genai (the builder's child, running), trained, want, untrained}."""
    folder = tmp_path_factory.mktemp("ship")
    config = tf.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, bos_token_id=1,
                            eos_token_id=2)
    torch.manual_seed(0)
    base = tf.LlamaForCausalLM(config).eval()
    base.save_pretrained(folder / "base")
    _tokenizer(folder / "base", config.vocab_size)
    builder = None
    if _has_genai():  # the builder runs in a child while this process converts
        builder = subprocess.Popen([sys.executable, "-c", BUILD, str(folder / "base"), str(folder / "genai")],
                                   cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    converted = ac.convert(base, ac.AttnResConfig(variant="block", num_blocks=2))
    trained = copy.deepcopy(converted)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "attnres" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 2)
    trained.save_pretrained(folder / "ckpt")
    prompt = torch.tensor([PROMPT])
    args = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    want = trained.generate(prompt, **args)[0, len(PROMPT):].tolist()
    untrained = converted.generate(prompt, **args)[0, len(PROMPT):].tolist()
    assert want != untrained  # the queries change the tokens: a route that drops them fails below
    return {"folder": folder, "ckpt": folder / "ckpt", "base": folder / "base", "builder": builder,
            "trained": trained, "want": want, "untrained": untrained}


def _has_genai() -> bool:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return False
    return True


def _tokens(model, capsys) -> list[int]:
    capsys.readouterr()
    assert main(["generate", str(model), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", str(NEW),
                 "--ignore-eos"]) == 0
    return [int(t) for t in capsys.readouterr().out.strip().splitlines()[0].split(",")]


def test_onnx_and_tvm_serve_the_trained_checkpoint(shipped, capsys):
    pytest.importorskip("tvm")
    onnx_file, artifact = shipped["folder"] / "m.onnx", shipped["folder"] / "art"
    capsys.readouterr()
    assert main(["rewrite", str(shipped["ckpt"]), "-o", str(onnx_file), "--with-past"]) == 0  # verified
    out = capsys.readouterr().out
    assert "sites are trained (non-zero queries): the file is checked against it at rtol 0.0001" in out
    assert "exported as 3 layers and grown to 4" in out
    assert "verification (the converted model vs the exported file, same inputs; also with zero rows in " \
           "past_key_values.0.key" in out
    assert _tokens(onnx_file, capsys) == shipped["want"]
    assert main(["compile", str(onnx_file), "-o", str(artifact), "--no-verify"]) == 0
    assert _tokens(artifact, capsys) == shipped["want"]


def test_pt2_serves_the_trained_checkpoint_and_loads_in_plain_torch(shipped, capsys):
    pt2 = shipped["folder"] / "m.pt2"
    assert main(["rewrite", str(shipped["ckpt"]), "-o", str(pt2), "--with-past", "--no-verify"]) == 0
    assert _tokens(pt2, capsys) == shipped["want"]
    trained = shipped["trained"]
    ids = torch.tensor([PROMPT])
    geometry = trained.get_decoder().attnres_state.geometry
    with torch.no_grad():
        want = trained(ids).logits
    torch.save((ids, geometry.empty_past(1, torch.float32, "cpu"), want), shipped["folder"] / "check.pt")
    fresh = subprocess.run([sys.executable, "-c", FRESH, str(pt2), str(shipped["folder"] / "check.pt")],
                           capture_output=True, text=True, timeout=300, cwd=shipped["folder"],
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert fresh.returncode == 0 and fresh.stdout.strip().splitlines()[-1] == "EQUAL", fresh.stderr[-2000:]


def test_genai_folder_rewritten_with_the_checkpoints_queries(shipped, capsys):
    builder = shipped["builder"]
    if builder is None:
        pytest.skip("onnxruntime-genai is not installed")
    assert builder.wait(timeout=300) == 0, builder.stderr.read()[-2000:]
    genai, out = shipped["folder"] / "genai", shipped["folder"] / "genai_trained"
    assert _tokens(genai, capsys) == shipped["untrained"]  # the base folder: what the conversion computes at zero
    out.mkdir()
    assert main(["rewrite", str(genai / "model.onnx"), "-o", str(out / "model.onnx"), "--queries",
                 str(shipped["ckpt"])]) == 0
    assert (out / "genai_config.json").is_file()
    assert _tokens(out, capsys) == shipped["want"]

    # queries that do not fit this model's sites: refused in one line, before any run
    import onnx

    from attnres_compile.hf import ship
    from attnres_compile.onnx import queries as onnx_queries

    model = onnx.load(str(out / "model.onnx"))
    _, found = ship.queries(shipped["ckpt"])
    for bad in ({**found, "chain0.site99": found["chain0.site1"]}, {**found, "chain0.site1": np.zeros(32, np.float32)}):
        with pytest.raises(InputError, match="queries do not fit this model") as caught:
            onnx_queries.check(model, bad, "ckpt")
        assert len(str(caught.value).splitlines()) == 1
    capsys.readouterr()
    assert main(["rewrite", str(genai / "model.onnx"), "-o", str(out / "x.onnx"), "--queries",
                 str(shipped["base"])]) == 6
    assert "not an AttnRes checkpoint folder" in capsys.readouterr().err


def test_bad_folders_fail_in_one_line(shipped, tmp_path, capsys):
    ckpt = shipped["ckpt"]
    (tmp_path / "empty").mkdir()
    newer, edited = tmp_path / "newer", tmp_path / "edited"
    for folder, change in ((newer, lambda c: c["attnres"].update(format=99)),
                           (edited, lambda c: c.update(num_hidden_layers=1))):
        shutil.copytree(ckpt, folder)
        config = json.loads((folder / "config.json").read_text())
        change(config)
        (folder / "config.json").write_text(json.dumps(config))
    cases = [(tmp_path / "empty", [], 6, "neither a Hugging Face checkpoint nor an AttnRes one"),
             (newer, [], 6, "saved by a newer attnres-compile"),
             (edited, [], 6, "site plan does not match its base architecture"),
             (ckpt, ["--blocks", "3"], 2, "its queries are for its own sites")]
    for folder, extra, code, message in cases:
        capsys.readouterr()
        assert main(["rewrite", str(folder), "-o", str(tmp_path / "x.onnx"), *extra]) == code, folder
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "x.onnx").exists()


def test_delta_checkpoint_ships_its_gates(shipped, capsys):
    """Delta AttnRes: a Delta-Block conversion with planted queries and gates (the gates are what
    make Delta differ from the original) reloads bitwise and serves its own tokens as an ONNX file
    and through the onnxruntime-genai folder rewritten with --queries."""
    folder = shipped["folder"] / "delta"
    converted = ac.convert(tf.LlamaForCausalLM.from_pretrained(shipped["base"]).eval(),
                           ac.AttnResConfig(variant="delta", num_blocks=2))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in converted.named_parameters():
            if "attnres" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 2)
    assert any(".gate" in name for name, _ in converted.named_parameters())
    converted.save_pretrained(folder / "ckpt")
    reloaded = ac.load(folder / "ckpt")
    prompt = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.equal(reloaded(prompt).logits, converted(prompt).logits)
    want = converted.generate(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, len(PROMPT):].tolist()
    assert want != shipped["untrained"]
    capsys.readouterr()
    assert main(["rewrite", str(folder / "ckpt"), "-o", str(folder / "m.onnx"), "--with-past", "--no-verify"]) == 0
    assert "grown to 4" in capsys.readouterr().out
    assert _tokens(folder / "m.onnx", capsys) == want
    builder = shipped["builder"]
    if builder is None:
        return
    assert builder.wait(timeout=300) == 0, builder.stderr.read()[-2000:]
    (folder / "genai").mkdir()
    assert main(["rewrite", str(shipped["folder"] / "genai" / "model.onnx"), "-o", str(folder / "genai" / "model.onnx"),
                 "--queries", str(folder / "ckpt")]) == 0
    assert _tokens(folder / "genai", capsys) == want
