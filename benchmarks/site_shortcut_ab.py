"""Per-site cost of torch.ops.attnres.depth_attention at width 256, 1 thread CPU time: the eager
shortcut (op(...)) against the dispatcher's way (op._op(...), what every call took before), and a
plain add (what a residual costs), interleaved rounds, no_grad; decode [1, 1, D] and forward [1, 128, D]."""
import statistics
import time

import torch

import attnres_compile  # noqa: F401  (registers torch.ops.attnres)

torch.set_num_threads(1)
op = torch.ops.attnres.depth_attention.default
ROUNDS, N = 9, 2000
def per_call(f, n):
    s = time.process_time()
    for _ in range(n): f()
    return (time.process_time() - s) / n * 1e6
print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, 1 thread, CPU us per call, median of {ROUNDS} interleaved rounds")
for T in (1, 128):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, T, 256, generator=g) for _ in range(9)]
    q = torch.nn.Parameter(torch.randn(256, generator=g))
    n = N if T == 1 else N // 10
    for count in (2, 5, 9):
        calls = {"add": lambda: torch.add(xs[0], xs[1]), "shortcut": lambda: op(xs[:count], q, 1e-6, 1.0, -1),
                 "dispatcher": lambda: op._op(xs[:count], q, 1e-6, 1.0, -1)}
        with torch.no_grad():
            for f in calls.values(): f()
            res = {k: [] for k in calls}
            for _ in range(ROUNDS):
                for k, f in calls.items(): res[k].append(per_call(f, n))
        med = {k: statistics.median(v) for k, v in res.items()}
        ratio = statistics.median(a / b for a, b in zip(res["shortcut"], res["dispatcher"]))
        print(f"[1, {T:3d}, 256] {count} sources: add {med['add']:6.2f}  op shortcut {med['shortcut']:6.2f}  "
              f"op via dispatcher {med['dispatcher']:6.2f}  shortcut/dispatcher x{ratio:.2f}")
