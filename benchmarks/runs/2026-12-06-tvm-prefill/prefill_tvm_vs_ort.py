"""Prefill of `bench decode`'s Llama decoder with past: onnxruntime against the TVM library compiled
from the same .onnx (one library, symbolic batch, sequence and past), 1 thread, process CPU time.

    PYTHONPATH=$PWD python benchmarks/runs/2026-12-06-tvm-prefill/prefill_tvm_vs_ort.py OUT.json [WIDTH ...]

Per width (default 256 1024; 24 sublayers = 12 layers, bench model's random HF Llama, seed as
`bench decode` makes it): the original decoder with past traced and exported as `bench decode` does
(decode.make_variants, decode.save_files: TVM default schedules), then one call each of a 128-token
prompt (batch 1, past 0) and of a one-token step after it, timed in interleaved rounds
(bench/timing.py, process CPU time) for onnxruntime, a second onnxruntime session of a copy of the
file (the control), the TVM library and a second load of a copy of it (the control). Logits are
compared first (TVM and the copies against onnxruntime). `tvm before` is the same .onnx built
again with `cpu_rules.tile_accumulators` switched off (the schedules before it), timed in the
same rounds. Then a per-kernel profile of each TVM prefill (profile.profile, CPU clock).
"""

import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from attnres_compile.bench.model.worker import load_tvm, onnxruntime_options, set_threads

set_threads(1)

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import tvm  # noqa: E402

from attnres_compile.backends.tvm import cpu_rules, profile  # noqa: E402
from attnres_compile.bench.decode.measure import measure as decode, route as decode_route
from attnres_compile.bench import timing  # noqa: E402

PROMPT, ROUNDS, MIN_TIME = 128, 5, 0.5


def feeds(heads, head_dims, ids):
    """(prefill feeds, step feeds): {name: array} in the decoder's input order."""
    prompt = {"input_ids": ids[:, :PROMPT], "attention_mask": np.ones((1, PROMPT), np.int64),
              "position_ids": np.arange(PROMPT, dtype=np.int64)[None]}
    empty = [np.zeros((1, h, 0, d), np.float32) for h, d in zip(heads, head_dims) for _ in range(2)]
    return prompt, empty


def ort_call(path):
    session = ort.InferenceSession(str(path), onnxruntime_options(1), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return lambda arrays: session.run(None, dict(zip(names, arrays)))


def tvm_call(path):
    vm, dev = load_tvm(str(path), "cpu")
    main = vm["main"]

    def call(arrays):
        return [o.numpy() if i == 0 else o for i, o in enumerate(main(*arrays))]
    return call, dev


def family(name: str) -> str:
    """An operator's family: its name without the numbers TVM appends, fused_ prefixes kept."""
    return re.sub(r"\d+$", "", name)


def measure(width: int, folder: Path) -> dict:
    job = {"factory": None, "model": "llama", "layers": 12, "width": width, "prefill": PROMPT, "steps": 1}
    model = decode_route.model_of(job)
    variants, geometry, args, spec = decode.make_variants(model, 8)
    original = variants[0]
    start = time.perf_counter()
    decode.save_files(original, args, spec, geometry["geometry"], folder, ["onnxruntime", "tvm"])
    build_s = time.perf_counter() - start
    for kind in ("onnx", "tvm"):
        shutil.copyfile(original.files[kind], folder / f"copy{original.files[kind].suffix}")
    files = dict(original.files)
    (folder / "before").mkdir()
    tile, cpu_rules.tile_accumulators = cpu_rules.tile_accumulators, lambda *args: None
    try:  # the build before the change: the same program, the accumulators left as TVM compacts them
        decode.save_files(original, args, spec, geometry["geometry"], folder / "before", ["tvm"])
    finally:
        cpu_rules.tile_accumulators = tile
    before, original.files = original.files["tvm"], files
    ids = np.random.default_rng(0).integers(0, 1000, (1, PROMPT + 1), dtype=np.int64)
    prompt, empty = feeds(geometry["heads"], geometry["head_dims"], ids)
    prefill_np = [*prompt.values(), *empty]
    ort_a, ort_b = ort_call(original.files["onnx"]), ort_call(folder / "copy.onnx")
    (tvm_a, dev), (tvm_b, _), (tvm_0, _) = (tvm_call(original.files["tvm"]), tvm_call(folder / "copy.so"),
                                             tvm_call(before))
    to_tvm = lambda arrays: [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in arrays]  # noqa: E731
    prefill_tvm = to_tvm(prefill_np)
    ref = ort_a(prefill_np)
    got = tvm_a(prefill_tvm)
    step_np = [ids[:, PROMPT:], np.ones((1, PROMPT + 1), np.int64), np.array([[PROMPT]], np.int64), *ref[1:]]
    step_tvm = [*to_tvm(step_np[:3]), *got[1:]]
    ref_step, got_step = ort_a(step_np), tvm_a(step_tvm)
    old, old_step = tvm_0(prefill_tvm), tvm_0(step_tvm)
    checks = {"prefill_logits_max_abs_err": float(np.abs(got[0] - ref[0]).max()),
              "step_logits_max_abs_err": float(np.abs(got_step[0] - ref_step[0]).max()),
              "before_prefill_logits_max_abs_err": float(np.abs(old[0] - ref[0]).max()),
              "before_step_logits_max_abs_err": float(np.abs(old_step[0] - ref_step[0]).max()),
              "logits_max_abs": float(np.abs(ref[0]).max())}
    out = {"width": width, "layers": 12, "prompt": PROMPT, "tvm_build_s": build_s, "checks": checks}
    for phase, (a_np, a_tvm) in {"prefill": (prefill_np, prefill_tvm), "step": (step_np, step_tvm)}.items():
        calls = {"onnxruntime": lambda a=a_np: ort_a(a), "onnxruntime copy": lambda a=a_np: ort_b(a),
                 "tvm": lambda a=a_tvm: tvm_a(a), "tvm copy": lambda a=a_tvm: tvm_b(a),
                 "tvm before": lambda a=a_tvm: tvm_0(a)}
        samples = timing.interleaved_clocks(calls, ROUNDS, MIN_TIME)
        cpu = {name: [x * 1e3 for x in s["cpu"]] for name, s in samples.items()}
        out[phase] = {"cpu_ms_rounds": cpu,
                      "cpu_ms_median": {n: statistics.median(v) for n, v in cpu.items()},
                      "ratio_tvm_to_ort": timing.paired_ratio(cpu["tvm"], cpu["onnxruntime"]),
                      "ratio_tvm_before_to_ort": timing.paired_ratio(cpu["tvm before"], cpu["onnxruntime"]),
                      "ratio_tvm_to_tvm_before": timing.paired_ratio(cpu["tvm"], cpu["tvm before"]),
                      "ratio_tvm_copy_to_tvm": timing.paired_ratio(cpu["tvm copy"], cpu["tvm"]),
                      "ratio_ort_copy_to_ort": timing.paired_ratio(cpu["onnxruntime copy"], cpu["onnxruntime"])}
    for name, path in (("tvm", original.files["tvm"]), ("tvm before", before)):
        prof = profile.profile(path, prefill_np, repeat=3, warmup=1)
        families: dict[str, float] = {}
        for row in prof["rows"]:
            families[family(row["name"])] = families.get(family(row["name"]), 0.0) + row["ms"]
        out[f"{name} prefill profile"] = {"forward_ms": prof["forward_ms"], "instrumented_ms": prof["instrumented_ms"],
                                          "by_family_ms": dict(sorted(families.items(), key=lambda kv: -kv[1])),
                                          "table": profile.format_table(prof, top=20)}
    return out


if __name__ == "__main__":
    widths = [int(w) for w in sys.argv[2:]] or [256, 1024]
    result = {"load_before": [round(x, 2) for x in os.getloadavg()], "runs": []}
    for width in widths:
        with tempfile.TemporaryDirectory(prefix=f"tvm-prefill-{width}-") as tmp:
            result["runs"].append(measure(width, Path(tmp)))
        r = result["runs"][-1]
        print(width, json.dumps({p: r[p]["cpu_ms_median"] for p in ("prefill", "step")}), r["checks"], flush=True)
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    Path(sys.argv[1]).write_text(json.dumps(result, indent=1) + "\n")
