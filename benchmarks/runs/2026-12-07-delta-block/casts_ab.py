"""Delta-Block's eager forward with the rewrite reading Llama's same-dtype casts through (new) and copying
them with their metadata checks (old, the rule before), interleaved with Block, the original and its copy."""
import copy, json, os, statistics, sys, time
import torch
torch.set_num_threads(1)
import attnres_compile as ac
from attnres_compile.fx import rewrite as fx_rewrite
from attnres_compile.bench.model.measure import make_model, make_inputs, rewrite_config
name, width = sys.argv[1], int(sys.argv[2])
reps = int(os.environ.get("REPS", 10))
model = make_model(name, 12, width, 128).eval()
args = tuple(torch.from_numpy(a) for a in make_inputs(1, 128).values())
prog = torch.export.export(model, args)
def rewritten(variant):
    r = ac.rewrite(prog, args, rewrite_config(variant, 8))
    return ac.two_phase(torch.export.export(r.graph_module, args).module()).graph_module
mods = {"original": ac.two_phase(prog.module()).graph_module, "block": rewritten("block"),
        "delta-block": rewritten("delta-block")}
keep, assert_op = fx_rewrite._returns_its_input, fx_rewrite._ASSERT
fx_rewrite._returns_its_input, fx_rewrite._ASSERT = (lambda *a: False), object()
mods["delta-block-old"] = rewritten("delta-block")
fx_rewrite._returns_its_input, fx_rewrite._ASSERT = keep, assert_op
mods["copy"] = copy.deepcopy(mods["original"])
casts = {k: sum(str(n.target) in ("aten.to.dtype", "aten._assert_tensor_metadata.default") for n in m.graph.nodes)
         for k, m in mods.items()}
with torch.no_grad():
    ref = mods["delta-block-old"](*args)
    assert torch.equal(mods["delta-block"](*args), ref)
    for m in mods.values():
        for _ in range(3): m(*args)
    times = {k: [] for k in mods}
    for r in range(7):
        for k, m in mods.items():
            t = time.process_time()
            for _ in range(reps): m(*args)
            times[k].append((time.process_time() - t) / reps * 1000)
med = {k: statistics.median(v) for k, v in times.items()}
print(name, width, "casts+checks", casts)
print(name, width, {k: f"{v:.2f} ms {100 * (v / med['original'] - 1):+.1f}%" for k, v in med.items()})
print(json.dumps({"name": name, "width": width, "casts_and_checks": casts, "ms": med, "rounds_ms": times}))
