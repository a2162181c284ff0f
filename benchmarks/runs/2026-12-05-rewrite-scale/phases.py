"""Per-phase wall and CPU time of a cold verified rewrite of the deep GPT."""
import os, sys, time, resource, tempfile, json
T0 = (time.perf_counter(), time.process_time())
rows = []
def now():
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter(), time.process_time(), ch.ru_utime + ch.ru_stime
def timed(name, fn):
    def wrap(*a, **k):
        w, c, ch = now()
        try:
            return fn(*a, **k)
        finally:
            w2, c2, ch2 = now()
            rows.append((name, w2 - w, c2 - c, ch2 - ch))
    return wrap
w, c, ch = now()
import torch
import attnres_compile as ac
from attnres_compile import api
from attnres_compile.core import verify
from attnres_compile.kernels import cache
sys.path.insert(0, os.getcwd())
from samples.models import GPT, _tokens
w2, c2, ch2 = now(); rows.append(("imports", w2 - w, c2 - c, ch2 - ch))
api.trace = timed("trace", api.trace)
api._analyze = timed("analysis", api._analyze)
api.apply_plan = timed("fx rewrite", api.apply_plan)
_run = verify.run
_n = [0]
def vrun(m, i):
    _n[0] += 1
    return timed("verify run original" if _n[0] % 2 else "verify run rewritten", _run)(m, i)
verify.run = vrun
api.build = timed("report", api.build)
cache.get = timed("kernel get (all)", cache.get)
import attnres_compile.kernels.fused as fused
fused.kernel_cache = cache
import importlib
_imp = lambda: importlib.import_module("attnres_compile.kernels.schedule") if "--tvm" in sys.argv else None
from attnres_compile.kernels import prebuild
prebuild.Worker.wait_for = timed("  wait_for worker", prebuild.Worker.wait_for)
prebuild.start = timed("prebuild start", prebuild.start)
prebuild.forward_specs = timed("prebuild forward_specs", prebuild.forward_specs)
prebuild.stop = timed("prebuild stop", prebuild.stop)
cache._export = timed("  export (codegen obj + gcc link)", cache._export)
cache._load = timed("  load", cache._load)
cache._store = timed("  store", cache._store)
_orig_func = cache._func
cache._func = timed("  tensorir func", cache._func)
variant = sys.argv[1]
with tempfile.TemporaryDirectory() as folder:
    os.environ["ATTNRES_KERNEL_CACHE"] = folder
    sched = _imp()
    torch.manual_seed(0)
    w, c, ch = now()
    model, (idx,) = GPT(dim=576, layers=30, heads=9).eval(), _tokens()
    rows.append(("model", *(b - a for a, b in zip((w, c, ch), now()))))
    cfg = ac.AttnResConfig(variant="block", num_blocks=8) if variant == "block8" else ac.AttnResConfig()
    w, c, ch = now()
    result = ac.rewrite(model, (idx,), cfg)
    rows.append(("REWRITE TOTAL", *(b - a for a, b in zip((w, c, ch), now()))))
agg = {}
for name, *v in rows:
    a = agg.setdefault(name, [0, 0, 0, 0]); a[0] += 1
    for i in range(3): a[i + 1] += v[i]
print(f"{'phase':36} {'n':>3} {'wall s':>8} {'cpu s':>8} {'child cpu s':>11}")
for name, (n, w, c, ch) in agg.items():
    print(f"{name:36} {n:>3} {w:8.2f} {c:8.2f} {ch:11.2f}")
print("kernels", len(cache._MEMORY), "load", os.getloadavg())
