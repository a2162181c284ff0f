"""Operator calls of one decode step (Llama 12 x 256 .pt2 from make_pt2.py): call_function nodes of the raw module, its lean copy and inference form; torch.profiler events a step, original against Block."""
import collections, torch
import attnres_compile
from attnres_compile.fx import lean as fx_lean
from attnres_compile.ops import depth_attention as op
torch.set_num_threads(1)
heads = torch.load("/tmp/d256/pt2_12/heads.pt")
ids = torch.randint(0, 1000, (1, 141))
prof = {}
for n in ("original", "block"):
    m = torch.export.load(f"/tmp/d256/pt2_12/{n}.pt2").module()
    lean = fx_lean.lean_copy(m)
    empty = [torch.zeros(1, h, 0, 256 // h) for h in heads for _ in range(2)]
    with torch.no_grad():
        out = m(ids[:, :140], torch.ones(1, 140, dtype=torch.long), torch.arange(140)[None], *empty)
        past = [v for k, v in out.items() if k.startswith("present.")]
        a = (ids[:, 140:141], torch.ones(1, 141, dtype=torch.long), torch.tensor([[140]]), *past)
        calls = lambda g: sum(1 for x in g.graph.nodes if x.op == "call_function")
        print(n, "call_function nodes: raw", calls(m), "lean", calls(lean.module), "inference", calls(lean.inference) if lean.inference else "-")
        for kind, mod in (("raw", m), ("lean", lean.module)):
            with torch.profiler.profile() as p:
                mod(*a)
            prof[(n, kind)] = collections.Counter(e.name for e in p.events())
for kind in ("raw", "lean"):
    o, b = prof[("original", kind)], prof[("block", kind)]
    print(kind, "profiler events a step: original", sum(o.values()), "block", sum(b.values()), "block extra", dict(b - o), "original extra", dict(o - b))
