"""One site, 1 thread: Block (add + site), Delta (2 adds + site), the fused step (needs delta-step.patch).
Usage: site_micro.py D [T [REPS]]."""
import time, torch
torch.set_num_threads(1)
import attnres_compile
from attnres_compile.ops.delta import depth_attention_delta as DELTA
from attnres_compile.ops.delta_step import depth_attention_delta_step as STEP
from attnres_compile.ops.depth_attention import depth_attention as SITE
import sys; D = int(sys.argv[1]); T = int(sys.argv[2]) if len(sys.argv) > 2 else 128
REPS = int(sys.argv[3]) if len(sys.argv) > 3 else 2000
for n in (2, 5, 9):
    src = [torch.randn(1, T, D) for _ in range(n - 1)]
    p_prev, d, h_prev = (torch.randn(1, T, D) for _ in range(3))
    w, g = torch.randn(D), torch.tensor([0.3])
    def unfused():
        h = h_prev + d; p = p_prev + d
        return DELTA([*src, p], w, h, g, 1e-6, 1.0, -1)
    def fusedf():
        return STEP(src, p_prev, d, h_prev, w, g, 1e-6, 1.0, -1)
    def block():
        p = p_prev + d
        return SITE([*src, p], w, 1e-6, 1.0, -1)
    def adds():
        h = h_prev + d; p = p_prev + d
    def delta_only():
        return DELTA([*src, p_prev], w, h_prev, g, 1e-6, 1.0, -1)
    with torch.no_grad():
        fs = dict(block=block, unfused=unfused, fused=fusedf, adds=adds, delta_only=delta_only)
        for f in fs.values():
            for _ in range(50): f()
        res = {k: [] for k in fs}
        for r in range(5):
            for k, f in fs.items():
                t = time.process_time()
                for _ in range(REPS): f()
                res[k].append((time.process_time() - t) / REPS * 1e6)
    print(n, {k: f"{sorted(v)[2]:.1f}us" for k, v in res.items()})
