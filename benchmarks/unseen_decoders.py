"""Generation on HF causal LMs the suite does not name: greedy tokens of the rewritten decoder
with a KV cache against the original's `generate()`, on every route.

    python benchmarks/unseen_decoders.py [NAME ...] [--tokens 32] [--routes torch,onnx,tvm] [--out FILE]

Per model: `rewrite(with_past=True)` (Block, N=2) and its verification; HF `generate()` through
`generation.causal_lm` (torch); the ONNX decoder-with-past (`export_onnx(with_past=True)`) in
onnxruntime through generate_loop; its TVM artifact (`compile`) through the same loop. Each
route's tokens must equal the original's. One line per model and route; a model the tool
handles today is only a starting point for the next one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's samples/, run from anywhere
from samples.hf_decoders import decoder as tiny_decoder  # noqa: E402

IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside the tiny vocabulary (Phi-3's pad is 32000)
MODELS = {
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, {}),
    "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, {"head_dim": 16}),
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, {"head_dim": 16, "sliding_window": 8}),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 16}),
    "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, {}),
    "granite": (tf.GraniteConfig, tf.GraniteForCausalLM, {}),
    "stablelm": (tf.StableLmConfig, tf.StableLmForCausalLM, {}),
    "cohere": (tf.CohereConfig, tf.CohereForCausalLM, {}),
    "starcoder2": (tf.Starcoder2Config, tf.Starcoder2ForCausalLM, {"sliding_window": 8}),
    "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, {}),
    "phi": (tf.PhiConfig, tf.PhiForCausalLM, {}),
    "opt": (tf.OPTConfig, tf.OPTForCausalLM, {"ffn_dim": 64, "word_embed_proj_dim": 32}),
    "bloom": (tf.BloomConfig, tf.BloomForCausalLM, {"n_head": 2, "n_layer": 2}),
    "falcon": (tf.FalconConfig, tf.FalconForCausalLM, {"new_decoder_architecture": True, "num_kv_heads": 1}),
    "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM, {"num_experts": 4, "num_experts_per_tok": 2,
                                                            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}),
    "smollm3": (tf.SmolLM3Config, tf.SmolLM3ForCausalLM, {}),
}


def build(name: str):
    """(model, example inputs) of a tiny random `name` with no end-of-sequence token."""
    config_cls, model_cls, extra = MODELS[name]
    return tiny_decoder(config_cls, model_cls, **IDS, **extra)


def check(name: str, tokens: int, routes: list[str], folder: Path) -> list[dict]:
    """One row per route: same tokens as the original's generate(), or the one-line failure."""
    import attnres_compile as ac
    from attnres_compile.fx import decoder
    from attnres_compile.generation import loop as generate_loop, serve as generation
    from attnres_compile.onnx.pipeline import export_onnx

    model, example = build(name)
    prompt = example["input_ids"][:, :5]
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens, do_sample=False)
    config = ac.AttnResConfig(variant="block", num_blocks=2)
    rows = []

    def row(route, run):
        start = time.perf_counter()
        try:
            got, detail = run()
            same = np.array_equal(np.asarray(got), expected.numpy())
            rows.append({"model": name, "route": route, "same_tokens": same, "detail": detail,
                         "seconds": round(time.perf_counter() - start, 1)})
        except Exception as exc:  # noqa: BLE001 - reported per route
            rows.append({"model": name, "route": route, "same_tokens": False, "error": f"{type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:300] if str(exc) else ''}", "seconds": round(time.perf_counter() - start, 1)})

    geometry = decoder.probe(model, prompt)[0]
    empty = {n: t.numpy() for n, t in zip(geometry.input_names()[3:], geometry.empty_past(prompt.shape[0]))}

    def torch_route():
        result = ac.rewrite(model, example, config, with_past=True)
        rows_ok = all(r["ok"] for r in result.report["verification"])
        got = generation.causal_lm(model, result.graph_module).generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens, do_sample=False)
        return got, f"{result.report['summary']['sites_rewritten']} sites, verification {'pass' if rows_ok else 'FAIL'}"

    def onnx_route():
        import onnxruntime as ort

        path = folder / f"{name}.onnx"
        result = export_onnx(model, example, path, config, with_past=True)
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        wanted = {i.name for i in session.get_inputs()}
        got = generate_loop.greedy(lambda f: dict(zip(names, session.run(None, {k: v for k, v in f.items() if k in wanted}))),
                                   prompt.numpy(), empty, tokens).tokens
        ok = all(r["ok"] for r in result.report["verification"])
        return got, f"verification {'pass' if ok else 'FAIL'}"

    def tvm_route():
        from attnres_compile.backends.tvm.runtime import load

        path, out = folder / f"{name}.onnx", folder / f"{name}-tvm"
        if not path.exists():
            raise RuntimeError("no .onnx (the onnx route failed)")
        proc = subprocess.run([sys.executable, "-m", "attnres_compile.cli", "compile", str(path), "-o", str(out), "--force"],
                              capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
        artifact = load(out)
        return generate_loop.greedy(artifact, prompt.numpy(), empty, tokens).tokens, "compiled"

    for route, run in (("torch", torch_route), ("onnx", onnx_route), ("tvm", tvm_route)):
        if route in routes:
            row(route, run)
    return rows


def in_fresh_processes(module: str, description: str) -> list[dict]:
    """The command line of a per-model script (`[NAME ...] [--layers 6] [--out FILE]`):
    `benchmarks.<module>.check(name, layers)` for each name, each in a fresh process, one JSON line
    printed per model (a crash is the model's row); the rows, with uptime, written to --out."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("names", nargs="*", default=list(MODELS))
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--out")
    args = parser.parse_args()
    names, layers, out = args.names, args.layers, args.out
    rows = []
    for name in names:
        code = f"import json, sys; sys.path.insert(0, {str(Path(__file__).parents[1])!r}); " \
               f"from benchmarks.{module} import check; print(json.dumps(check({name!r}, {layers})))"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        row = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else \
            {"model": name, "error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1][:200]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if out:
        Path(out).write_text(json.dumps({"uptime": subprocess.run(["uptime"], capture_output=True, text=True)
                                         .stdout.strip(), "rows": rows}, indent=1) + "\n")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"models (default all): {', '.join(MODELS)}")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt (default 32)")
    parser.add_argument("--routes", default="torch,onnx,tvm", help="comma-separated: torch, onnx, tvm")
    parser.add_argument("--out", help="also write the rows as JSON to this file")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="unseen-decoders-") as folder:
        for name in args.names or MODELS:
            for r in check(name, args.tokens, args.routes.split(","), Path(folder)):
                verdict = "same tokens" if r["same_tokens"] else r.get("error", "DIFFERENT TOKENS")
                print(f"{r['model']:12} {r['route']:6} {r['seconds']:6.1f}s  {verdict}  {r.get('detail', '')}", flush=True)
                rows.append(r)
    if args.out:
        Path(args.out).write_text(json.dumps({"tokens": args.tokens, "transformers": tf.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
