"""The probe behind `compile --prefill`: one decoder-with-past ONNX file (bench decode's random HF Llama, 24
sublayers, or a factory's model), its TVM library as `bench decode` builds it (batch, sequence and past symbolic)
beside the same file built with every input's dims fixed (batch 1, PROMPT tokens, past 0), and onnxruntime: logits
compared, then a PROMPT-token prefill timed in 5 interleaved rounds (bench/timing.py), 1 thread, process CPU time.

    PYTHONPATH=$PWD python benchmarks/runs/2026-12-07-tvm-fixed-shapes/static_prefill.py WIDTH [FACTORY]
    PYTHONPATH=$PWD python benchmarks/runs/2026-12-07-tvm-fixed-shapes/static_prefill.py 576 samples.smollm2:factory
"""

import json, os, shutil, statistics, sys, tempfile, time
from pathlib import Path
from attnres_compile.bench.model.worker import load_tvm, onnxruntime_options, set_threads
set_threads(1)
import numpy as np, onnxruntime as ort, tvm
from attnres_compile.bench.decode import measure as decode, route as decode_route
from attnres_compile.bench import timing
from attnres_compile.backends.tvm.importers import import_model
from attnres_compile.backends.tvm.pipeline import build, make_target
from attnres_compile.backends.tvm import vm_files

PROMPT = int(os.environ.get("PROMPT", 128))
width = int(sys.argv[1]); factory = sys.argv[2] if len(sys.argv) > 2 else None
folder = Path(tempfile.mkdtemp(prefix="sp-"))
job = {"factory": factory, "model": "llama", "layers": 12, "width": width, "prefill": PROMPT, "steps": 1}
model = decode_route.model_of(job)
variants, geometry, args, spec = decode.make_variants(model, 8)
original = variants[0]
t = time.perf_counter(); decode.save_files(original, args, spec, geometry["geometry"], folder, ["onnxruntime", "tvm"]); print("sym build", time.perf_counter()-t, flush=True)
onnx_path = original.files["onnx"]
heads, hd = geometry["heads"], geometry["head_dims"]
ids = np.random.default_rng(0).integers(0, 1000, (1, PROMPT), dtype=np.int64)
prompt = [ids, np.ones((1, PROMPT), np.int64), np.arange(PROMPT, dtype=np.int64)[None]]
empty = [np.zeros((1, h, 0, d), np.float32) for h, d in zip(heads, hd) for _ in range(2)]
feeds = prompt + empty
sess = ort.InferenceSession(str(onnx_path), onnxruntime_options(1), providers=["CPUExecutionProvider"])
names = [i.name for i in sess.get_inputs()]
static = {n: tuple(a.shape) for n, a in zip(names, feeds)}
t = time.perf_counter()
imp = import_model(onnx_path, static)
built = build(imp, make_target("llvm"), input_shapes=static)
vm_files.save(built.executable, folder / "static.so"); print("static build", time.perf_counter()-t, flush=True)
vm_s, dev = load_tvm(str(original.files["tvm"]), "cpu"); vm_t, _ = load_tvm(str(folder / "static.so"), "cpu")
tv = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in feeds]
ref = sess.run(None, dict(zip(names, feeds)))
a = vm_s["main"](*tv); b = vm_t["main"](*tv)
print("err sym", float(np.abs(a[0].numpy()-ref[0]).max()), "err static", float(np.abs(b[0].numpy()-ref[0]).max()), "kv", float(np.abs(b[1].numpy()-ref[1]).max()))
calls = {"ort": lambda: sess.run(None, dict(zip(names, feeds))), "tvm sym": lambda: vm_s["main"](*tv), "tvm static": lambda: vm_t["main"](*tv)}
s = timing.interleaved_clocks(calls, 5, 0.5)
cpu = {n: statistics.median(v["cpu"]) * 1e3 for n, v in s.items()}
print(width, factory, PROMPT, json.dumps(cpu), "load", os.getloadavg())
