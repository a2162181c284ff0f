"""One SmolLM2 decode step of a TVM artifact (batch 1, one token after a 128-token prefill made by the same
artifact), timed plain (30 steps, median, 1 thread, CPU time: the VM call alone and the Artifact call with its
numpy copies) and through the VM's instrument hook (profile.timed_forwards, 20 steps): the costliest calls per step.
Usage: python profile_step.py ARTIFACT"""
import os
import sys
import time

os.environ["TVM_NUM_THREADS"] = "1"
import numpy as np  # noqa: E402
import tvm  # noqa: E402

from attnres_compile.backends.tvm import profile as P  # noqa: E402
from attnres_compile.backends.tvm.runtime import load  # noqa: E402

art = load(sys.argv[1])
vm, dev = art.vm, art.device
ids = np.random.default_rng(0).integers(0, 49152, (1, 129))
past = [np.zeros((1, 3, 0, 64), np.float32)] * 60
T = lambda a: tvm.runtime.tensor(np.ascontiguousarray(a), dev)  # noqa: E731
out = vm["main"](*map(T, [ids[:, :128], np.ones((1, 128), np.int64), np.arange(128)[None], *past]))
args = [T(ids[:, 128:129]), T(np.ones((1, 129), np.int64)), T(np.array([[128]]))] + list(out)[1:]
feeds = dict(zip(art.input_names, [a.numpy() for a in args]))
P.timed_forwards(vm, args, dev, 3, "cpu", instrument=False)
plain = P.timed_forwards(vm, args, dev, 30, "cpu", instrument=False)
whole = []
for _ in range(30):
    t = time.process_time(); art(feeds); whole.append(time.process_time() - t)
inst = P.timed_forwards(vm, args, dev, 20, "cpu")
tot: dict = {}
for f in inst:
    for n, t in f.calls:
        e = tot.setdefault(n, [0, 0.0]); e[0] += 1; e[1] += t
print(f"vm call ms {np.median([f.seconds for f in plain]) * 1e3:.3f}  Artifact call ms {np.median(whole) * 1e3:.3f}  "
      f"instrumented ms {np.median([f.seconds for f in inst]) * 1e3:.3f}  load {os.getloadavg()[0]:.2f}")
s = sum(t for _, t in tot.values())
for n, (c, t) in sorted(tot.items(), key=lambda x: -x[1][1])[:40]:
    print(f"{t / 20 * 1e3:8.3f} ms {t / s * 100:5.1f}% {c / 20:5.0f} {n}")
