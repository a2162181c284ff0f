"""SmolLM2-135M rewritten (Block N=8, `rewrite --with-past`): one-token decode in onnxruntime and in
the TVM artifact compiled from the same file, 1 thread each, CPU time per token.

    attnres-compile rewrite samples.smollm2:factory -o smol.onnx --with-past --blocks 8
    attnres-compile compile smol.onnx -o smol_tvm
    PYTHONPATH=$PWD python benchmarks/runs/2026-12-06-smollm2-decode/decode_tvm_vs_ort.py smol.onnx smol_tvm

A prompt of 128 tokens of pydoc text (prefill, untimed per token), then 64 greedy tokens; rounds
alternate the runtimes; per round the process CPU time of each step (the 63 one-token steps after the prefill) (1 thread:
onnxruntime's intra-op pool of 1, TVM_NUM_THREADS=1) and their wall time. Tokens compared.
"""

import json
import os
import statistics
import sys
import time

os.environ["TVM_NUM_THREADS"] = "1"

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402

from attnres_compile.backends.tvm.runtime import load  # noqa: E402
from attnres_compile.generation.loop import greedy  # noqa: E402
from samples import smollm2  # noqa: E402

onnx_path, artifact_path = sys.argv[1], sys.argv[2]
ROUNDS, PROMPT, NEW = 5, 128, 64


def ort_step():
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads, options.log_severity_level = 1, 1, 3
    session = ort.InferenceSession(onnx_path, options, providers=["CPUExecutionProvider"])
    names, wanted = [o.name for o in session.get_outputs()], {i.name for i in session.get_inputs()}
    past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in session.get_inputs()
            if i.name.startswith("past_key_values.")}
    return (lambda feeds: dict(zip(names, session.run(None, {k: v for k, v in feeds.items() if k in wanted})))), past


def tvm_step():
    artifact = load(artifact_path)
    wanted = set(artifact.input_names)
    past = {i["name"]: np.zeros((1, i["shape"][1], 0, i["shape"][3]), np.dtype(i["dtype"]))
            for i in artifact.manifest["inputs"] if i["name"].startswith("past_key_values.")}
    return (lambda feeds: artifact({k: v for k, v in feeds.items() if k in wanted})), past


_, tokenizer = smollm2.load()
prompt = np.array([tokenizer(smollm2.text())["input_ids"][:PROMPT]], dtype=np.int64)
runtimes = {"onnxruntime": ort_step(), "tvm": tvm_step()}
rows = {name: [] for name in runtimes}
tokens = {}
for name, (step, past) in runtimes.items():  # warm-up: plan memory, load code
    greedy(step, prompt, past, 4)


def timed(step, cpu: list):
    """The step, its process CPU seconds appended to `cpu` per call (the first call is the prefill)."""
    def run(feeds):
        c0 = time.process_time()
        out = step(feeds)
        cpu.append(time.process_time() - c0)
        return out
    return run


load_before = os.getloadavg()
for r in range(ROUNDS):
    for name, (step, past) in runtimes.items():
        cpu: list[float] = []
        out = greedy(timed(step, cpu), prompt, past, NEW)
        rows[name].append({"prefill_cpu_s": cpu[0], "decode_cpu_ms_per_token": 1e3 * sum(cpu[1:]) / len(cpu[1:]),
                           "decode_wall_ms_per_token": 1e3 * out.decode_s / len(cpu[1:])})
        tokens[name] = out.new_tokens[0]
result = {"prompt_tokens": PROMPT, "new_tokens": NEW, "rounds": ROUNDS,
          "load": [round(x, 2) for x in load_before + os.getloadavg()],
          "same_tokens": tokens["onnxruntime"] == tokens["tvm"], "rows": rows}
for name, rs in rows.items():
    result[name] = {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]}
result["tvm_over_onnxruntime_cpu"] = round(result["tvm"]["decode_cpu_ms_per_token"]
                                           / result["onnxruntime"]["decode_cpu_ms_per_token"], 3)
print(json.dumps(result, indent=1))
