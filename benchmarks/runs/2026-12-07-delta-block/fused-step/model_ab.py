"""Eager forward (and train step) of Delta-Block with and without fuse_delta_steps, beside Block and the original."""
import sys, time, copy, json, statistics
import torch
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
import attnres_compile as ac
from attnres_compile.bench.model.measure import make_model, make_inputs, rewrite_config
name, width = sys.argv[1], int(sys.argv[2])
model = make_model(name, 12, width, 128).eval()
inp = make_inputs(1, 128)
args = tuple(torch.from_numpy(a) for a in inp.values())
prog = torch.export.export(model, args)
mods = {"original": prog.module()}
for v in ("block", "delta-block"):
    r = ac.rewrite(prog, args, rewrite_config(v, 8))
    mods[v] = torch.export.export(r.graph_module, args).module()
mods["delta-block-fused"] = ac.fuse_delta_steps(copy.deepcopy(mods["delta-block"])).graph_module
mods["copy"] = copy.deepcopy(mods["original"])
with torch.no_grad():
    ref = mods["delta-block"](*args)
    assert torch.equal(mods["delta-block-fused"](*args), ref)
def fwd(m):
    with torch.no_grad():
        m(*args)
def train(m):
    out = m(*args)
    out.float().pow(2).mean().backward()
    for p in m.parameters(): p.grad = None
mode = sys.argv[4] if len(sys.argv) > 4 else "fwd"
fn = fwd if mode == "fwd" else train
import os; reps = int(os.environ.get("REPS", 10 if mode == "fwd" else 3))
for m in mods.values():
    for _ in range(3): fn(m)
times = {k: [] for k in mods}
for r in range(7):
    for k, m in mods.items():
        t = time.process_time()
        for _ in range(reps): fn(m)
        times[k].append((time.process_time() - t) / reps * 1000)
med = {k: statistics.median(v) for k, v in times.items()}
base = med["original"]
print(name, width, mode, "threads", torch.get_num_threads(), {k: f"{v:.2f}ms {100*(v/base-1):+.1f}%" for k, v in med.items()})
print(json.dumps({"name": name, "width": width, "mode": mode, "ms": med, "all": times}))
