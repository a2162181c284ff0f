"""The decode step of profile_step.py on onnxruntime (1 thread): the 128-token prefill in a plain session, then
30 one-token steps timed plain (CPU time, median) and 25 under onnxruntime's profiler (a second session with
SessionOptions.enable_profiling; the last 20 steps counted, the first 5 warm it up; wall microseconds)
Usage: python onnxruntime_step.py smol.onnx"""
import json
import os
import sys
import time
from collections import defaultdict

import numpy as np
import onnxruntime as ort


def session(path, profile=False):
    o = ort.SessionOptions()
    o.intra_op_num_threads, o.inter_op_num_threads, o.log_severity_level = 1, 1, 3
    if profile:
        o.enable_profiling, o.profile_file_prefix = True, "/tmp/smoltvm_ortprof"
    return ort.InferenceSession(path, o, providers=["CPUExecutionProvider"])


s = session(sys.argv[1])
names = [i.name for i in s.get_inputs()]
ids = np.random.default_rng(0).integers(0, 49152, (1, 129))
past = s.run(None, dict(zip(names, [ids[:, :128], np.ones((1, 128), np.int64), np.arange(128)[None]]
                            + [np.zeros((1, 3, 0, 64), np.float32)] * 60)))[1:]
feed = dict(zip(names, [ids[:, 128:], np.ones((1, 129), np.int64), np.array([[128]])] + past))
for _ in range(3):
    s.run(None, feed)
ts = []
for _ in range(30):
    t = time.process_time(); s.run(None, feed); ts.append(time.process_time() - t)
p = session(sys.argv[1], profile=True)
for _ in range(25):
    p.run(None, feed)
events = json.load(open(p.end_profiling()))
runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "Session" and e["name"] == "model_run")
start = runs[-20][0]
by_type, by_node = defaultdict(lambda: [0, 0.0]), defaultdict(float)
for e in events:
    if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start:
        t = by_type[e["args"]["op_name"]]; t[0] += 1; t[1] += e["dur"]
        by_node[e["name"][:-len("_kernel_time")] + " " + e["args"]["op_name"]] += e["dur"]
total = sum(t for _, t in by_type.values())
print(f"onnxruntime step ms {np.median(ts) * 1e3:.3f}  profiled kernels ms {total / 20 / 1e3:.3f}  "
      f"profiled step ms {np.median([b - a for a, b in runs[-20:]]) / 1e3:.3f}  load {os.getloadavg()[0]:.2f}")
for name, (n, t) in sorted(by_type.items(), key=lambda x: -x[1][1]):
    print(f"{t / 20 / 1e3:8.3f} ms {t / total * 100:5.1f}% {n / 20:5.0f} {name}")
print("costliest nodes:")
for name, t in sorted(by_node.items(), key=lambda x: -x[1])[:15]:
    print(f"{t / 20 / 1e3:8.3f} ms {name}")
