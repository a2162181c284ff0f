"""One cold verified rewrite of SmolLM2-135M-Instruct (Full or Block(8)), empty kernel cache.

    PYTHONPATH=$PWD python benchmarks/runs/2026-12-06-rewrite-scale/smollm2_cold.py {block8,full}

The model is loaded first (its dense copy under the cache folder, samples/smollm2.py) and not timed;
`ac.rewrite` is timed whole: trace, analysis, fx rewrite, the verification's two runs and every
forward kernel it builds. Prints one JSON line (wall, process CPU, children CPU, load average).
"""

import json
import os
import resource
import sys
import tempfile
import time

os.environ["ATTNRES_KERNEL_CACHE"] = tempfile.mkdtemp()

import torch  # noqa: E402

import attnres_compile as ac  # noqa: E402
from samples import smollm2  # noqa: E402

variant = sys.argv[1]
model, inputs = smollm2.factory()
config = ac.AttnResConfig(variant="full") if variant == "full" else ac.AttnResConfig(variant="block", num_blocks=8)
load = os.getloadavg()
w0, c0 = time.perf_counter(), time.process_time()
result = ac.rewrite(model, inputs, config)
wall, cpu = time.perf_counter() - w0, time.process_time() - c0
children = resource.getrusage(resource.RUSAGE_CHILDREN)
checks = result.report["verification"]
print(json.dumps({"model": "SmolLM2-135M-Instruct", "variant": variant, "tokens": list(inputs["input_ids"].shape),
                  "rewrite_s": round(wall, 1), "rewrite_cpu_s": round(cpu, 1),
                  "children_cpu_s": round(children.ru_utime + children.ru_stime, 1),
                  "load": [round(x, 1) for x in load], "torch_threads": torch.get_num_threads(),
                  "outputs_verified": sum(bool(r.get("ok")) for r in checks), "outputs": len(checks)}))
