"""HF architectures from tiny configs (samples/hf_zoo.py): link counts a person derives from each
architecture (the derivation is written next to each), exact preserve rewrites (Full and Block)
on the fx path, the CLI's `.onnx` outputs (and `.pt2` for one model of each family) reloaded in
a fresh process at another batch size, and the fx and ONNX analyses agreeing on every HF model of
the suite (T5's and the suite's own models' under -m heavy).

The ONNX exports are the expensive part (~3-9 s of CPU each): two worker processes, started by
the first test, make them (the original model's ONNX file for each agreement test selected, then the CLI's
`rewrite FACTORY -o X.onnx`, and `-o X.pt2` for PT2) while the fx tests run, so a 2-core runner
is busy.
"""

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import onnx
import pytest
import torch

import attnres_compile as ac
from attnres_compile.fx import hf_experts
from attnres_compile.fx.trace import trace
from attnres_compile.core.config import AttnResConfig
from attnres_compile.core.chain_analysis import NOT_LEARNED, analyze
from attnres_compile.onnx.view import view_from_onnx
from samples import hf_models, hf_zoo

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).parents[1]

# name -> (expected (links, sources) per chain, in graph order; derivation)
EXPECTED = {
    "t5": ([(4, 5), (6, 7)], "pre-norm encoder-decoder: 2 encoder layers x (self-attn, FF) = 4 links; "
                             "2 decoder layers x (self-attn, cross-attn, FF) = 6 links; one stream each"),
    "whisper": ([(4, 5), (6, 7)], "as T5 (the conv front end and positions feed the encoder root)"),
    "swin": ([(4, 5), (4, 5)], "2 stages x 2 blocks x (window attention, MLP); patch merging (LN + linear to 2x width) "
                               "between the stages starts a new stream"),
    "dinov2": ([(4, 5)], "2 layers x (attn, MLP), each branch x + gamma * f(x) (layer scale)"),
    "deit": ([(4, 5)], "2 layers x (attn, MLP); class and distillation tokens ride along in the stream"),
    "convnext": ([(2, 3), (2, 3)], "2 stages x 2 blocks, one link per block (dwconv, LN, MLP, gamma); "
                                   "a strided conv between the stages"),
    "mobilenetv2": ([(1, 2), (2, 3), (3, 4), (2, 3), (2, 3)],
                    "inverted residual groups (t, c, n, s) = (1,16,1,1) (6,24,2,2) (6,32,3,2) (6,64,4,2) (6,96,3,1) "
                    "(6,160,3,2) (6,320,1,1): the first block of a group changes width or stride, the other n-1 "
                    "are links: 0+1+2+3+2+2+0 = 10 links in chains of 1, 2, 3, 2, 2 (the 1-link chain is short)"),
    "phi": ([(2, 5)], "2 layers, each one link x + attn(ln x) + mlp(ln x) (parallel: 2 branches); the GELU-tanh "
                      "adds x + 0.044715*x**3 in each MLP are not links"),
    "falcon": ([(2, 5)], "2 layers, each x + dropout_add(mlp += attn) (parallel, summed in place: 2 branches)"),
    "gpt_neox": ([(2, 5)], "2 layers, parallel residual x + attn(ln1 x) + mlp(ln2 x): 2 branches each"),
    "qwen2": ([(4, 5)], "pre-norm decoder: 2 layers x (attn, MLP)"),
    "gemma": ([(4, 5)], "pre-norm decoder: 2 layers x (attn, MLP)"),
    "mixtral": ([(4, 5)], "pre-norm decoder: 2 layers x (attn, sparse MoE); the experts' weighted sum is "
                          "inside the MoE branch, not a link"),
}
SUITE = {  # the HF models of the rest of the suite, for the fx/ONNX agreement
    "gpt2": ([(4, 5)], "2 layers x (attn, MLP); GELU-new's internal adds are not links"),
    "llama": ([(4, 5)], "2 layers x (attn, MLP)"),
    "vit": ([(4, 5)], "2 layers x (attn, MLP)"),
    "bert": ([(1, 2)] * 4, "post-norm LN(x + f(x)): 4 links, each its own chain (reported, not rewritten)"),
    "resnet": ([(1, 2), (1, 2), (1, 2), (1, 2)], "basic blocks relu(x + f(x)): 3 + 2 blocks, the first of stage 2 "
                                                  "has a projection shortcut; post-activation: one chain per link"),
}
FACTORIES = {**hf_zoo.ZOO, **{name: getattr(hf_models, f"{name}_factory") for name in SUITE}}
CONFIGS = {"full": AttnResConfig(), "block": AttnResConfig(variant="block", num_blocks=2)}


WORKER = textwrap.dedent("""
    import contextlib, io, json, sys
    import onnx, torch
    from attnres_compile import cli
    from attnres_compile.onnx import export as onnx_export
    from samples import hf_models, hf_zoo

    torch.set_num_threads(1)
    folder, names = sys.argv[1], sys.argv[5:]
    cli_names, pt2_names, agree = (sys.argv[i].split(",") for i in (2, 3, 4))
    results = {}
    for name in [n for n in names if n in agree or n in cli_names]:
        factory = hf_zoo.ZOO.get(name) or getattr(hf_models, f"{name}_factory")
        model, inputs = factory()
        if name in agree:
            onnx.save(onnx_export.export(model, (), inputs), f"{folder}/{name}.original.onnx")
        if name not in cli_names:
            continue
        for suffix in ("onnx", "pt2") if name in pt2_names else ("onnx",):
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli.main(["rewrite", f"samples.hf_zoo:{name}_factory", "-o", f"{folder}/{name}.{suffix}",
                                 "--blocks", "2", "--no-verify", "--report", f"{folder}/{name}.{suffix}.json"])
            results[f"{name}.{suffix}"] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
    print(json.dumps(results))
""")

RELOAD = textwrap.dedent("""
    import json, os, sys
    import numpy as np, onnxruntime, torch
    import attnres_compile
    from attnres_compile import pt2
    from samples.hf_zoo import ZOO

    torch.set_num_threads(1)
    out = {}
    for name in sys.argv[2:]:
        model, inputs = ZOO[name]()
        tensors = {k: torch.cat([v, v[:1]]) for k, v in inputs.items() if isinstance(v, torch.Tensor)}  # batch 3
        with torch.no_grad():
            expected = [t for t in torch.utils._pytree.tree_leaves(model(**{**inputs, **tensors}))
                        if isinstance(t, torch.Tensor)]
        sess = onnxruntime.InferenceSession(f"{sys.argv[1]}/{name}.onnx", providers=["CPUExecutionProvider"])
        got_onnx = sess.run(None, {i.name: tensors[i.name].numpy() for i in sess.get_inputs()})
        rel = lambda e, g: float(np.abs(e.numpy() - np.asarray(g)).max() / np.abs(e.numpy()).max())
        out[name] = {"onnx": max(rel(e, g) for e, g in zip(expected, got_onnx)),
                     "outputs": [len(expected), len(got_onnx)], "names": [[o.name for o in sess.get_outputs()]]}
        if os.path.exists(f"{sys.argv[1]}/{name}.pt2"):
            archive = pt2.load(f"{sys.argv[1]}/{name}.pt2")
            with torch.no_grad():  # plain torch, the original call (its use_cache=False a constant input)
                got_pt2 = archive.program.module()(**{**inputs, **tensors})
            got_pt2 = [t for t in torch.utils._pytree.tree_leaves(got_pt2) if isinstance(t, torch.Tensor)]
            out[name]["pt2"] = max(rel(e, g) for e, g in zip(expected, got_pt2))
            out[name]["outputs"].append(len(got_pt2))
            out[name]["names"].append(archive.outputs)
    print(json.dumps(out))
""")
# through the CLI: ten architectures (DeiT and Gemma, near copies of ViT and Llama, only on the fx path;
# T5, the costliest export at 34 s of CPU, only on the fx path and in the agreement: Whisper is the
# encoder-decoder that goes through the CLI)
CLI = [name for name in EXPECTED if name not in ("deit", "gemma", "t5")]
# `-o X.pt2` for one of each family (encoder-decoder, windowed vision, CNN, parallel decoder): the
# archive's path does not depend on the architecture beyond its inputs and outputs, and each costs
# a torch.export (the other six took 60 s of CPU)
PT2 = ["whisper", "swin", "convnext", "phi"]
# two halves of about equal export cost (the encoder-decoders and the convnets cost most)
HALVES = (["t5", "mobilenetv2", "falcon", "qwen2", "gpt_neox", "deit", "gpt2", "vit", "resnet"],
          ["whisper", "swin", "phi", "gemma", "dinov2", "convnext", "llama", "bert", "mixtral"])


def _python(code: str, *argv: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=env)


def _json(proc: subprocess.Popen, timeout: float = 900) -> dict:
    stdout, stderr = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


class Workers:
    """The two worker processes and their output folder; `results()` waits for both once. `agree`: the
    models whose original ONNX file the selected agreement tests read (T5's only under -m heavy)."""

    def __init__(self, folder: Path, agree: list[str]):
        self.folder = folder
        self.procs = [_python(WORKER, str(folder), ",".join(CLI), ",".join(PT2), ",".join(agree), *half)
                      for half in HALVES]
        self._results = None

    def results(self) -> dict:
        if self._results is None:
            self._results = {k: v for proc in self.procs for k, v in _json(proc).items()}
        return self._results

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="module")
def workers(tmp_path_factory, request):
    agree = [item.callspec.params["name"] for item in request.session.items
             if getattr(item, "originalname", None) == "test_fx_and_onnx_analyses_agree"]
    w = Workers(tmp_path_factory.mktemp("zoo"), agree)
    yield w
    w.stop()


@functools.lru_cache(maxsize=None)
def _traced(name: str):
    """(model, inputs, traced GraphModule) of a zoo model, traced once per test session."""
    model, inputs = FACTORIES[name]()
    return model, inputs, trace(model, inputs).graph_module


def _chains(report) -> list[tuple[int, int]]:
    return [(c["links"], c["sources"]) for c in report["chains"]]


def _leaves(out) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _max_rel_err(model, gm, inputs) -> float:
    """Max |diff| over max |ref| across the float outputs of the original module and `gm`."""
    with torch.no_grad():
        pairs = list(zip(_leaves(model(**inputs)), _leaves(gm(**inputs))))
    assert pairs
    return max(((a - b).abs().max() / a.abs().max()).item() for a, b in pairs)


@pytest.mark.parametrize("name", EXPECTED)
def test_links_and_exact_preserve_rewrite(name, workers):
    model, inputs, gm = _traced(name)
    report = ac.inspect(gm, inputs)
    assert _chains(report) == EXPECTED[name][0], EXPECTED[name][1]
    if name == "phi":
        assert sum(a["reason"] == NOT_LEARNED for a in report["skipped_adds"]) == 2
    for variant, config in CONFIGS.items():
        result = ac.rewrite(gm, inputs, config)
        assert all(row["verdict"] == "pass" for row in result.report["verification"]), (variant, result.report)
        rewritten = [(c["links"], c["sources"]) for c in result.report["chains"] if c["status"] == "rewritten"]
        assert rewritten == [c for c in EXPECTED[name][0] if c[0] >= 2]
        err = _max_rel_err(model, result.graph_module, inputs)
        print(f"{name} {variant}: links {_chains(report)}, max |diff| / max |ref| {err:.1e}")
        assert err <= 1e-5, variant


def test_moe_experts_traced_with_standard_ops():
    """transformers runs Mixtral's experts as its custom op grouped_mm_fallback, which neither
    torch.onnx nor TVM can import: the trace uses batched_mm instead, says so, and leaves the
    model passed in as it was."""
    model, inputs = hf_zoo.mixtral_factory()
    traced = trace(model, inputs)
    ops = {str(n.target) for n in traced.graph_module.graph.nodes if n.op == "call_function"}
    assert not [op for op in ops if op.startswith("transformers.")], sorted(ops)
    assert hf_experts.NOTE in traced.notes
    assert model.get_experts_implementation() == {"": hf_experts.FROM}


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.heavy) if n == "t5" or n in SUITE else n
                                  for n in [*EXPECTED, *SUITE]])
def test_fx_and_onnx_analyses_agree(name, workers):
    """The same model through torch.export (fx) and through its ONNX export: same links, sources and sites.
    T5 (34 s of CPU) and the suite's own models (GPT-2, Llama, ViT, BERT, ResNet, whose ONNX files the
    ONNX and TVM tests analyse and rewrite) under -m heavy."""
    workers.results()
    _, inputs, gm = _traced(name)
    fx_plan = ac.inspect(gm, inputs)
    proto = onnx.load(str(workers.folder / f"{name}.original.onnx"))
    onnx_plan = analyze(view_from_onnx(proto), AttnResConfig())
    onnx_chains = [(len(c.links), len(c.sources), c.rewrite, c.feature_size) for c in onnx_plan.chains]
    fx_chains = [(c["links"], c["sources"], c["status"] == "planned", c["feature_size"]) for c in fx_plan["chains"]]
    assert onnx_chains == fx_chains
    assert [[len(link.branches) for link in c.links] for c in onnx_plan.chains] == \
        [[len(site["branches"]) for site in c["detail"]] for c in fx_plan["chains"]]
    assert _chains(fx_plan) == ({**EXPECTED, **SUITE})[name][0]


@pytest.mark.slow
def test_cli_onnx_and_pt2_reload_in_a_fresh_process(workers):
    """`rewrite FACTORY -o X.onnx` (Block) for ten zoo models and `-o X.pt2` for four (in the
    worker processes), then fresh processes load each file, run it at batch 3 (traced at 2) and
    match the original: that is the verification (the CLI's own runs are skipped to save CI time)."""
    results = workers.results()
    assert set(PT2) <= set(CLI)
    for name in CLI:
        for suffix in ("onnx", "pt2") if name in PT2 else ("onnx",):
            run = results[f"{name}.{suffix}"]
            assert run["code"] == 0, (name, suffix, run["stderr"])
            assert max(len(line) for line in run["stdout"].splitlines()) < 200  # no shape expressions
            report = json.loads((workers.folder / f"{name}.{suffix}.json").read_text())
            assert [c["links"] for c in report["chains"] if c["status"] == "rewritten"] == \
                [links for links, _ in EXPECTED[name][0] if links >= 2], (name, suffix)
            assert report["dynamic_dims"], name
    swin = onnx.load(str(workers.folder / "swin.onnx"), load_external_data=False).graph.input[0]
    dims = [d.dim_param or d.dim_value for d in swin.type.tensor_type.shape.dim]
    assert isinstance(dims[0], str) and dims[1:] == [3, 32, 32]  # Swin: dynamic batch, static image size
    reloads = [_python(RELOAD, str(workers.folder), *[n for n in half if n in CLI]) for half in HALVES]
    for name, r in {k: v for proc in reloads for k, v in _json(proc).items()}.items():
        pt2_err = f", pt2 {r['pt2']:.1e}" if "pt2" in r else ""
        print(f"{name}: reloaded at batch 3, max |diff| / max |ref|: onnx {r['onnx']:.1e}{pt2_err}")
        assert ("pt2" in r) == (name in PT2), name
        assert len(set(r["outputs"])) == 1 and len(r["outputs"]) == 2 + (name in PT2), (name, r)
        assert all(names == r["names"][0] for names in r["names"]), (name, r["names"])  # the model's own output names
        assert r["onnx"] <= 1e-5 and r.get("pt2", 0) <= 1e-5, (name, r)
