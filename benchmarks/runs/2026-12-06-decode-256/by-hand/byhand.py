"""One decode step at past 140, Llama L x 256 .pt2 (original, Block N=8): the raw module (what bench decode's
eager ran before), its lean copy's checked form (sites through the op's shortcut) and its inference form
(sites straight to the kernel), and that form with fused.forward stubbed to an empty output (the site's
call and allocation without the kernel); 1-thread CPU, interleaved rounds of 5 steps. python byhand.py 12 41"""
import collections, time, sys, statistics
import torch
import attnres_compile
from attnres_compile.fx import lean as fx_lean
from attnres_compile.kernels import fused
torch.set_num_threads(1)
layers, rounds = int(sys.argv[1]), int(sys.argv[2])
heads = torch.load(f"/tmp/d256/pt2_{layers}/heads.pt")
ids = torch.randint(0, 1000, (1, 141))
cands, steps = {}, {}
for n in ("original", "block"):
    m = torch.export.load(f"/tmp/d256/pt2_{layers}/{n}.pt2").module()
    empty = [torch.zeros(1, h, 0, 256 // h) for h in heads for _ in range(2)]
    with torch.no_grad():
        out = m(ids[:, :140], torch.ones(1, 140, dtype=torch.long), torch.arange(140)[None], *empty)
    past = [v for k, v in out.items() if k.startswith("present.")]
    steps[n] = (ids[:, 140:141], torch.ones(1, 141, dtype=torch.long), torch.tensor([[140]]), *past)
    lean = fx_lean.lean_copy(m)
    cands[(n, "raw")] = m
    cands[(n, "lean checked")] = lean.module
    if lean.inference is not None:
        cands[(n, "lean inference")] = lean.inference
        cands[(n, "inference, kernel stubbed")] = lambda *a, mod=lean.inference: mod(*a)
samples = collections.defaultdict(list)
stub = lambda sources, query, eps, scale, dim: torch.empty_like(sources[0])
real = fused.forward
with torch.no_grad():
    for r in range(rounds):
        for (n, kind), mod in cands.items():
            fused.forward = stub if "stubbed" in kind else real
            a = steps[n]
            t = time.process_time()
            for _ in range(5): mod(*a)
            samples[(n, kind)].append((time.process_time() - t) / 5 * 1e3)
fused.forward = real
q1 = lambda v: statistics.quantiles(v, n=4)[0]
for (n, kind), v in samples.items():
    o = samples[("original", "raw" if kind == "raw" else "lean checked")]
    print(f"{n:8s} {kind:28s} min {min(v):6.3f} q1 {q1(v):6.3f} median {statistics.median(v):6.3f} ms"
          f"   over the original ({'raw' if kind == 'raw' else 'lean'}): q1 {q1(v)/q1(o)-1:+.1%} median {statistics.median(v)/statistics.median(o)-1:+.1%}")
