"""onnxruntime's own ONNX files: default-domain ops onnx lacks, and residual adds fused into Skip*LayerNormalization.

Real files from the real producers: onnxruntime-genai's model builder on a tiny saved Llama
(SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization, GroupQueryAttention) and
`onnxruntime.transformers.optimizer` on torch.onnx exports of tiny GPT-2 and BERT
(SkipLayerNormalization with the bias folded in). Each must load, its fused norms unfused
(onnx/unfuse_skip_norm.py) must compute what the fused file computes in onnxruntime,
the links must be found, and `rewrite` must pass its own verification and match the original
in an independent onnxruntime run. Hand-built graphs check each rule against onnxruntime's
kernels (bias, beta, default epsilon, both RMS norms) and the checker's refusals.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from attnres_compile import AttnResConfig
from attnres_compile.cli import main
from attnres_compile.core.errors import AttnResError, CorruptModelError
from attnres_compile.onnx.pipeline import inspect_onnx, rewrite_onnx
from attnres_compile.onnx import io as onnx_io
from attnres_compile.onnx.unfuse_skip_norm import unfuse

HIDDEN, HEADS, KV_HEADS, LAYERS = 64, 4, 2, 2
DIMS = {"batch_size": 1, "batch": 2,  # GroupQueryAttention: batch 1 when a past is given
        "sequence_length": 5, "seq": 5, "past_sequence_length": 3,
        "total_sequence_length": 8, "kv_cache_dim": HIDDEN // HEADS}


def _feeds(session: ort.InferenceSession, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs for `session` at DIMS: token ids below 100, all-ones masks, normal floats."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in session.get_inputs():
        shape = [d if isinstance(d, int) else DIMS[d] for d in i.shape]
        if "mask" in i.name:
            feeds[i.name] = np.ones(shape, np.int64)
        elif i.type == "tensor(int64)":
            feeds[i.name] = rng.integers(0, 100, shape, dtype=np.int64)
        else:
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _run(model: onnx.ModelProto | str, feeds=None) -> tuple[list[np.ndarray], dict]:
    source = model if isinstance(model, str) else model.SerializeToString()
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    feeds = feeds if feeds is not None else _feeds(session)
    return session.run(None, feeds), feeds


def _assert_close(actual: list[np.ndarray], expected: list[np.ndarray], rtol: float = 1e-5) -> float:
    """Every output within rtol of the largest magnitude of its reference; the worst max abs / scale."""
    worst = 0.0
    for a, e in zip(actual, expected, strict=True):
        scale = max(float(np.abs(e).max()), 1e-30)
        error = float(np.abs(a - e).max()) / scale
        assert error <= rtol, (error, scale)
        worst = max(worst, error)
    return worst


def _unfused_equals_original(path) -> dict[str, int]:
    """The file at `path` unfused computes, in onnxruntime, what it computes fused; returns the counts."""
    model = onnx_io.load(path)
    counts = unfuse(model, onnx_io.default_opset(model)).counts
    assert not any(n.op_type.startswith("Skip") for n in model.graph.node)
    expected, feeds = _run(str(path))
    actual, _ = _run(model, feeds)
    _assert_close(actual, expected)
    return counts


def _rewrite_equals_original(path, out, config: AttnResConfig | None = None):
    result = rewrite_onnx(path, out, config)
    rows = result.report["verification"]
    assert rows and all(r["ok"] for r in rows), rows
    expected, feeds = _run(str(path))
    actual, _ = _run(str(out), feeds)
    _assert_close(actual, expected)
    assert not any(n.op_type.startswith("Skip") for n in onnx.load(str(out), load_external_data=False).graph.node)
    return result.report


# the real producers


GENAI_BUILDS = {  # folder -> (architecture, precision, hidden, heads, kv heads): head sizes 16 and 32
    "llama": ("llama", "fp32", HIDDEN, HEADS, KV_HEADS),
    "llama_int4": ("llama", "int4", 64, 2, 1),   # MatMulNBits; onnxruntime's CPU GroupQueryAttention takes
    "qwen2": ("qwen2", "fp32", 64, 2, 1),        # head sizes that are multiples of 16 only
}
BUILD = """import sys
from onnxruntime_genai.models import builder
for hf, out, precision in zip(*[iter(sys.argv[1:])] * 3):
    args = ("", hf, out, precision, "cpu", out + "_cache")
    builder.create_model(*args, **builder.parse_extra_options(*args, {}))
"""


@pytest.fixture(scope="module")
def genai_folders(tmp_path_factory) -> dict[str, str]:
    """onnxruntime-genai's builder (cpu) on tiny Llama and Qwen2 models saved with save_pretrained from configs,
    all built in one child (the builder's imports cost more than the builds): {name: model.onnx}."""
    pytest.importorskip("onnxruntime_genai")
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("genai")
    vocab = {f"t{i}": i for i in range(128)}  # the builder reads a tokenizer beside the weights
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")
    argv = []
    for name, (arch, precision, hidden, heads, kv) in GENAI_BUILDS.items():
        config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                     "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]
        config = config_class(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden,
                              num_hidden_layers=LAYERS, num_attention_heads=heads, num_key_value_heads=kv,
                              max_position_embeddings=64)
        torch.manual_seed(0)
        model = model_class(config).eval()
        _randomize(model)  # Qwen2's q/k/v biases too: a zero bias the builder would leave out
        model.save_pretrained(folder / name / "hf")
        tokenizer.save_pretrained(folder / name / "hf")
        argv += [str(folder / name / "hf"), str(folder / name / "out"), precision]
    subprocess.run([sys.executable, "-c", BUILD, *argv], check=True, capture_output=True, timeout=300, cwd=folder)
    return {name: str(folder / name / "out" / "model.onnx") for name in GENAI_BUILDS}


@pytest.fixture(scope="module")
def genai_llama(genai_folders) -> str:
    return genai_folders["llama"]


def _randomize(model: torch.nn.Module) -> None:
    """Biases and norm weights drawn at random: HF initialises them to 0 and 1, which would hide a bias or
    gamma the unfusing drops (and onnxruntime's optimizer merges equal initializers)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name.lower() or "ln_" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=generator))


def _ort_optimized(kind: str, folder) -> str:
    """A tiny HF GPT-2 or BERT exported with torch.onnx (legacy exporter) and fused by onnxruntime's optimizer."""
    from onnxruntime.transformers.optimizer import optimize_model

    from samples import hf_models

    model, inputs = hf_models.gpt2_factory() if kind == "gpt2" else hf_models.bert_factory()
    model.set_attn_implementation("eager")  # the optimizer fuses BERT's eager attention (and then its embedding)
    _randomize(model)
    if kind == "gpt2":
        module = hf_models.CausalLMLogits(model).eval()
    else:
        class Hidden(torch.nn.Module):
            def __init__(self, bert):
                super().__init__()
                self.bert = bert

            def forward(self, input_ids, attention_mask):
                return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        module = Hidden(model).eval()
    names = ["input_ids", "attention_mask"]
    exported, fused = folder / f"{kind}.onnx", folder / f"{kind}_opt.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (inputs["input_ids"], inputs["attention_mask"]), str(exported), dynamo=False,
                          opset_version=17, input_names=names, output_names=["out"],
                          dynamic_axes={n: {0: "batch", 1: "seq"} for n in names})
    optimized = optimize_model(str(exported), model_type=kind, num_heads=2, hidden_size=32)
    counts = optimized.get_fused_operator_statistics()
    assert counts["SkipLayerNormalization"] == 4
    if kind == "bert":
        assert counts["EmbedLayerNormalization"] == 1 and counts["Attention"] == 2
    optimized.save_model_to_file(str(fused))
    return str(fused)


@pytest.fixture(scope="module")
def ort_gpt2(tmp_path_factory) -> str:
    return _ort_optimized("gpt2", tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def ort_bert(tmp_path_factory) -> str:
    return _ort_optimized("bert", tmp_path_factory.mktemp("bert"))


@pytest.mark.slow
def test_genai_llama_loads_unfuses_and_rewrites(genai_llama, tmp_path, capsys):
    """4 SkipSimplifiedLayerNormalization (2 per layer, the last one the final norm) are the 4 residual adds of
    one chain; the file loads although onnx's checker has no SimplifiedLayerNormalization."""
    model = onnx.load(genai_llama, load_external_data=False)
    assert {"SimplifiedLayerNormalization", "GroupQueryAttention"} <= {n.op_type for n in model.graph.node}
    assert _unfused_equals_original(genai_llama) == {"SkipSimplifiedLayerNormalization": 2 * LAYERS}
    assert not onnx.defs.has("SimplifiedLayerNormalization")  # registered for the check only
    report = inspect_onnx(genai_llama)
    assert report["unfused"] == {"SkipSimplifiedLayerNormalization": 2 * LAYERS}
    assert report["summary"]["links"] == 2 * LAYERS and len(report["chains"]) == 1
    notes = " ".join(report["notes"])
    assert "onnxruntime runs: SimplifiedLayerNormalization" in notes and "unfused 4 SkipSimplified" in notes
    assert main(["inspect", genai_llama]) == 0
    assert "4 in 4 residual links" in capsys.readouterr().out
    report = _rewrite_equals_original(genai_llama, tmp_path / "attnres.onnx")
    assert report["chains"][0]["status"] == "rewritten" and report["summary"]["sites_rewritten"] == 2 * LAYERS


@pytest.mark.slow
def test_ort_optimized_gpt2_rewrites(ort_gpt2, tmp_path):
    """GPT-2 fused by onnxruntime's optimizer: 4 SkipLayerNormalization (two with the projection bias) give
    the pre-norm chain of 4 links back."""
    assert _unfused_equals_original(ort_gpt2) == {"SkipLayerNormalization": 4}
    report = _rewrite_equals_original(ort_gpt2, tmp_path / "attnres.onnx")
    assert report["unfused"] == {"SkipLayerNormalization": 4}
    assert report["summary"]["links"] == 4 and [c["status"] for c in report["chains"]] == ["rewritten"]


@pytest.mark.slow
def test_ort_optimized_bert_finds_post_norm_links(ort_bert, tmp_path):
    """BERT (post-norm) fused with its embedding (EmbedLayerNormalization) and attention (Attention): 4 links,
    each its own chain (the stream goes through LayerNorm), the first from the fused embedding's output;
    min_chain=1 rewrites them exactly; `contrib_ops` says how each fused op was read."""
    assert _unfused_equals_original(ort_bert) == {"SkipLayerNormalization": 4}
    report = inspect_onnx(ort_bert)
    assert report["summary"]["links"] == 4 and [c["links"] for c in report["chains"]] == [1] * 4
    report = _rewrite_equals_original(ort_bert, tmp_path / "attnres.onnx", AttnResConfig(min_chain=1))
    assert [c["status"] for c in report["chains"]] == ["rewritten"] * 4
    embed = next(n for n in onnx.load(ort_bert, load_external_data=False).graph.node
                 if n.op_type == "EmbedLayerNormalization")
    assert report["chains"][0]["root"] == embed.output[0]  # no embedding_sum output: the normed sum starts it
    read = {r["op"].rsplit(".", 1)[1]: r for r in report["contrib_ops"]}
    assert read["EmbedLayerNormalization"]["read"] == "stream root" and read["EmbedLayerNormalization"]["nodes"] == [embed.name]
    assert "is the root of chain 0" in read["EmbedLayerNormalization"]["reason"]
    assert read["Attention"]["read"] == "opaque" and "sublayer op (attention)" in read["Attention"]["reason"]
    assert read["SkipLayerNormalization"] == {"op": "com.microsoft.SkipLayerNormalization", "count": 4, "read": "unfused",
                                              "reason": "its residual add unfused into Add + norm before the analysis"}


# each rule against onnxruntime's kernel, on hand-built graphs

N = 8


def _fused(op: str, opset: int, bias: bool, beta: bool = True, epsilon: float | None = None,
           outputs: tuple[str, ...] = ("y", "", "", "sum")) -> onnx.ModelProto:
    """x, s -> op(x, s, gamma[, beta][, bias]) -> (y, sum); `sum` read by a Mul so output 3 has a consumer."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal(N).astype(np.float32), n) for n in ("gamma", "beta", "bias")]
    inputs = ["x", "s", "gamma"]
    if op == "SkipLayerNormalization":
        inputs += ["beta" if beta else "", "bias" if bias else ""]
    elif bias:
        inputs += ["bias"]
    attrs = {} if epsilon is None else {"epsilon": epsilon}
    nodes = [helper.make_node(op, inputs, list(outputs), domain="com.microsoft", **attrs)]
    graph_outputs = ["y"]
    if outputs[3]:
        nodes.append(helper.make_node("Mul", ["sum", "sum"], ["sum2"]))
        graph_outputs.append("sum2")
    graph_outputs += [o for o in outputs[1:3] if o]
    value = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "t", N]) for n in ("x", "s")]
    graph = helper.make_graph(nodes, "g", value, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                                                 for o in graph_outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)])


def _inputs(scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2)
    return {n: (scale * rng.standard_normal((2, 3, N))).astype(np.float32) for n in ("x", "s")}


@pytest.mark.parametrize("op,opset,norm", [("SkipLayerNormalization", 17, "LayerNormalization"),
                                           ("SkipSimplifiedLayerNormalization", 22, "SimplifiedLayerNormalization"),
                                           ("SkipSimplifiedLayerNormalization", 23, "RMSNormalization")])
@pytest.mark.parametrize("bias", [False, True])
def test_rule_matches_onnxruntime_kernel(op, opset, norm, bias):
    """Output and input_skip_bias_sum as onnxruntime's fused kernel computes them; the bias added to `input`."""
    fused = _fused(op, opset, bias, epsilon=1e-6)
    unfused = onnx.ModelProto()
    unfused.CopyFrom(fused)
    assert unfuse(unfused, opset).counts == {op: 1}
    ops = [n.op_type for n in unfused.graph.node]
    assert ops == ["Add"] * (1 + bias) + [norm, "Mul"]
    if bias:
        assert list(unfused.graph.node[0].input) == ["x", "bias"]
    expected, feeds = _run(fused, _inputs())
    _assert_close(_run(unfused, feeds)[0], expected)


@pytest.mark.parametrize("op", ["SkipLayerNormalization", "SkipSimplifiedLayerNormalization"])
def test_default_epsilon_is_onnxruntime_s(op):
    """Without an epsilon attribute onnxruntime uses 1e-12, not LayerNormalization's 1e-5: on rows of
    variance ~1e-8 the difference is of order 1."""
    fused = _fused(op, 17, bias=False, beta=False)
    unfused = onnx.ModelProto()
    unfused.CopyFrom(fused)
    unfuse(unfused, 17)
    expected, feeds = _run(fused, _inputs(1e-4))
    _assert_close(_run(unfused, feeds)[0], expected)


def test_kept_fused_with_reason():
    """A node whose training statistics are read stays fused, named with its reason; an opset without
    LayerNormalization keeps SkipLayerNormalization."""
    model = _fused("SkipLayerNormalization", 17, bias=False, outputs=("y", "mean", "", "sum"))
    result = unfuse(model, 17)
    assert result.counts == {} and "mean or inv_std_var" in result.kept[0][1]
    assert "kept as they are" in " ".join(result.notes())
    result = unfuse(_fused("SkipLayerNormalization", 16, bias=False), 16)
    assert result.counts == {} and "opset 16 has no LayerNormalization" in result.kept[0][1]


# the checker: only ops onnxruntime runs are let through, and checked against its schema


def _default_domain_op(tmp_path, op: str, **attrs) -> str:
    node = helper.make_node(op, ["x", "w"], ["y"], axis=-1, epsilon=1e-6, **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, N])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, N])],
                              [numpy_helper.from_array(np.ones(N, np.float32), "w")])
    path = tmp_path / f"{op}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)]), str(path))
    return str(path)


def test_ort_default_domain_op_loads_with_note(tmp_path):
    path = _default_domain_op(tmp_path, "SimplifiedLayerNormalization")
    assert onnx_io.ort_only_ops(onnx_io.load(path)) == ["SimplifiedLayerNormalization"]
    assert any("onnxruntime runs: SimplifiedLayerNormalization" in n for n in inspect_onnx(path)["notes"])


def test_unknown_or_malformed_default_domain_ops_stay_refused(tmp_path, capsys):
    """An op neither onnx nor onnxruntime defines, and onnxruntime's op with an attribute its schema does
    not have: exit 9, one line."""
    for path, what in ((_default_domain_op(tmp_path, "NoSuchNormalization"), "No Op registered for NoSuch"),
                       (_default_domain_op(tmp_path, "SimplifiedLayerNormalization", bogus=1), "bogus")):
        with pytest.raises(CorruptModelError, match=what):
            onnx_io.load(path)
        assert main(["inspect", path]) == 9
        err = capsys.readouterr().err.strip()
        assert err.startswith("attnres-compile: error:") and "invalid ONNX model" in err and "\n" not in err
    assert not onnx.defs.has("SimplifiedLayerNormalization")


def test_generate_runs_a_genai_folder_with_og_generator(genai_llama):
    """`generate GENAI_FOLDER`: og.Generator's greedy tokens. Prompts of 6 and 4 tokens in one batch
    (right-padded, as og takes them) give each row's tokens alone; the second row stops at the
    folder's eos_token_id (og keeps it out of the row) unless --ignore-eos; --eos-id and the decoder file
    alone are refused in one line."""
    from forked_cli import run_cli

    folder = Path(genai_llama).parent
    rows = [[5, 17, 42, 8, 99, 3], [7, 2, 60, 11]]
    alone = [_genai_tokens(folder, [row], new=10)[0][len(row):] for row in rows]
    assert len(alone[0]) == 10 and 0 < len(alone[1]) < 10  # row 1 stops early: the check below covers a stop
    argv = ["generate", folder, "--prompt-ids", "5,17,42,8,99,3", "--prompt-ids", "7,2,60,11", "--max-new-tokens", "10"]
    run = run_cli([*argv, "--json"])
    assert run.code == 0, run.stderr
    data = json.loads(run.stdout)
    assert data["runtime"] == "onnxruntime-genai (og.Generator)" and data["new_tokens"] == alone
    assert data["stopped"] == [False, True] and data["eos_token_ids"] == [2] and data["pad_token_id"] == 2
    run = run_cli([*argv, "--json", "--ignore-eos"])
    assert run.code == 0 and json.loads(run.stdout)["new_token_counts"] == [10, 10], run.stderr
    run = run_cli([*argv, "--eos-id", "3"])
    assert run.code == 2 and len(run.lines) == 1 and "genai_config.json" in run.lines[0], run.stderr
    run = run_cli(["generate", genai_llama, "--prompt-ids", "5,17"])  # its decoder file alone
    assert run.code == 6 and len(run.lines) == 1 and "generate with the folder" in run.lines[0], run.stderr


def _genai_tokens(folder, prompt: list[list[int]], new: int = 16) -> list[list[int]]:
    og = pytest.importorskip("onnxruntime_genai")
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt[0]) + new, do_sample=False, batch_size=len(prompt))
    generator = og.Generator(model, params)
    generator.append_tokens(np.array(prompt, dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [[int(t) for t in generator.get_sequence(i)] for i in range(len(prompt))]


@pytest.mark.slow
def test_genai_folder_in_genai_folder_out(genai_llama, tmp_path):
    """A rewrite into another folder carries the genai config (decoder file renamed) and the tokenizer
    files; og.Generator on the new folder gives the original folder's greedy tokens, batch 1 and 2."""
    out = tmp_path / "attnres" / "decoder.onnx"
    result = rewrite_onnx(genai_llama, out)
    names = sorted(p.name for p in out.parent.iterdir())
    assert {"genai_config.json", "tokenizer.json", "decoder.onnx"} <= set(names) and "model.onnx" not in names
    assert json.loads((out.parent / "genai_config.json").read_text())["model"]["decoder"]["filename"] == "decoder.onnx"
    assert any("onnxruntime-genai folder" in n for n in result.report["notes"])
    original = Path(genai_llama).parent
    for prompt in ([[5, 17, 42, 8, 99, 3]], [[5, 17, 42, 8, 99, 3], [7, 7, 21, 60, 2, 11]]):
        want = _genai_tokens(original, prompt)
        assert _genai_tokens(out.parent, prompt) == want and all(len(w) == 22 for w in want)
    with pytest.raises(AttnResError, match="exists: pass --force"):
        rewrite_onnx(genai_llama, out)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_int4", "qwen2"])
def test_genai_int4_and_qwen2_verify_and_generate(genai_folders, name, tmp_path):
    """An int4 builder file (MatMulNBits) and a Qwen2 one (q/k/v biases), head size 32: verification sizes
    `kv_cache_dim` from GroupQueryAttention's attributes and its packed q/k/v width (no --input-shape; a free
    16 fails the original, exit 15) and `total_sequence_length` as past + sequence; og.Generator on the
    rewritten folder gives the original folder's greedy tokens, batch 1 and 2."""
    path = genai_folders[name]
    ops = {n.op_type for n in onnx.load(path, load_external_data=False).graph.node}
    assert "GroupQueryAttention" in ops and ("MatMulNBits" in ops) == (name == "llama_int4")
    out = tmp_path / "attnres" / "model.onnx"
    report = rewrite_onnx(path, out).report
    assert report["verification"] and all(r["ok"] for r in report["verification"]), report["verification"]
    assert report["summary"]["sites_rewritten"] == 2 * LAYERS
    opaque = {r["op"].rsplit(".", 1)[1] for r in report["contrib_ops"] if r["read"] == "opaque" and r["reason"].endswith("fine")}
    assert opaque == ({"GroupQueryAttention", "MatMulNBits"} if name == "llama_int4" else {"GroupQueryAttention"})
    assert any(n.startswith("verified with kv_cache_dim = 32: the head size GroupQueryAttention") for n in report["notes"])
    for shapes in report["verified_shapes"]:
        past = shapes["past_key_values.0.key"]
        assert past[-1] == 32 and shapes["attention_mask"][1] == past[2] + shapes["input_ids"][1], shapes
    for prompt in ([[5, 17, 42, 8, 99, 3]], [[5, 17, 42, 8, 99, 3], [7, 7, 21, 60, 2, 11]]):
        assert _genai_tokens(out.parent, prompt) == _genai_tokens(Path(path).parent, prompt)


def _embed_pre_norm(path: Path, with_sum: bool = True) -> str:
    """A pre-norm stream that EmbedLayerNormalization starts, as onnxruntime's optimizer fuses GPT-2's embedding
    (`fuse_gpt2`): output 2, the embedding sum, is the first skip; output 0, its LayerNorm, feeds the first
    branch; two links `h + W relu(norm(h))`, the second branch through a LayerNormalization of h1."""
    rng = np.random.default_rng(3)
    d, vocab = N, 20
    tensors = {"word": (vocab, d), "pos": (16, d), "seg": (2, d), "gamma": (d,), "beta": (d,), "w1": (d, d),
               "w2": (d, d), "g2": (d,)}
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name) for name, shape in tensors.items()]
    outputs = ["normed", "mask_index", "emb_sum" if with_sum else ""]
    nodes = [helper.make_node("Cast", ["ids"], ["ids32"], to=TensorProto.INT32),
             helper.make_node("Mul", ["ids32", "zero"], ["segments"]),
             helper.make_node("EmbedLayerNormalization", ["ids32", "segments", "word", "pos", "seg", "gamma", "beta"],
                              outputs, domain="com.microsoft", name="embed", epsilon=1e-5),
             helper.make_node("Relu", ["normed"], ["r1"]), helper.make_node("MatMul", ["r1", "w1"], ["b1"]),
             helper.make_node("Add", ["emb_sum" if with_sum else "normed", "b1"], ["h1"]),
             helper.make_node("LayerNormalization", ["h1", "g2"], ["n2"], axis=-1),
             helper.make_node("MatMul", ["n2", "w2"], ["b2"]), helper.make_node("Add", ["h1", "b2"], ["h2"])]
    inits.append(numpy_helper.from_array(np.zeros((), np.int32), "zero"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "t"])],
                              [helper.make_tensor_value_info("h2", TensorProto.FLOAT, ["b", "t", d])], inits)
    graph.value_info.extend(helper.make_tensor_value_info(v, TensorProto.FLOAT, ["b", "t", d])  # as the optimizer's
                            for v in outputs[::2] if v)                                             # files carry
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(path))
    return str(path)


def test_embed_layer_norm_sum_roots_a_pre_norm_stream(tmp_path):
    """EmbedLayerNormalization's embedding sum (output 2) is the root: its normed output 0, which the first branch
    reads, is read as a function of it, so both links are found (without that the first link's branch does
    not depend on its skip and the chain is the second link alone); the rewrite verifies in onnxruntime and
    matches the fused original."""
    path = _embed_pre_norm(tmp_path / "embed.onnx")
    report = inspect_onnx(path)
    assert report["summary"]["links"] == 2 and [c["root"] for c in report["chains"]] == ["emb_sum"]
    row = next(r for r in report["contrib_ops"] if r["op"] == "com.microsoft.EmbedLayerNormalization")
    assert row["nodes"] == ["embed"] and "output 2, the embedding sum" in row["reason"] and "root of chain 0" in row["reason"]
    assert any(n.startswith("EmbedLayerNormalization read as the embedding sum: embed:") for n in report["notes"])
    feeds = {"ids": np.random.default_rng(4).integers(0, 20, (2, 5))}
    result = rewrite_onnx(path, tmp_path / "out.onnx")
    assert result.report["summary"]["sites_rewritten"] == 2 and all(r["ok"] for r in result.report["verification"])
    _assert_close(_run(str(tmp_path / "out.onnx"), feeds)[0], _run(path, feeds)[0])
    # without a sum output the normed output starts the stream (a post-norm-like root), as in BERT
    report = inspect_onnx(_embed_pre_norm(tmp_path / "no_sum.onnx", with_sum=False))
    assert [c["root"] for c in report["chains"]] == ["normed"] and report["summary"]["links"] == 2


@pytest.mark.slow
def test_compile_refuses_onnxruntime_ops_in_one_line(genai_folders, ort_bert, tmp_path, capsys):
    """`compile` of a file with ops only onnxruntime runs stops before any weight is read, exit 13, one line naming
    them and what to do (a genai folder: run it with onnxruntime / generate), nothing written."""
    from attnres_compile.backends.tvm.importers import check_importable

    out = tmp_path / "tvm"
    assert main(["compile", genai_folders["llama_int4"], "-o", str(out)]) == 13
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and not out.exists()
    matmuls = sum(n.op_type == "MatMulNBits" for n in onnx.load(genai_folders["llama_int4"], load_external_data=False).graph.node)
    assert ("TVM's ONNX import cannot take: SimplifiedLayerNormalization, com.microsoft.GroupQueryAttention x2, "
            f"com.microsoft.MatMulNBits x{matmuls}, com.microsoft.SkipSimplifiedLayerNormalization x4; run it with "
            "onnxruntime as it is") in err
    assert "onnxruntime-genai folder" in err
    with pytest.raises(AttnResError, match=r"com\.microsoft\.Attention x2, com\.microsoft\.BiasGelu x2, com\.microsoft\."
                       r"EmbedLayerNormalization, com\.microsoft\.SkipLayerNormalization x4; run it with onnxruntime"):
        check_importable(onnx.load(ort_bert, load_external_data=False), Path(ort_bert))
