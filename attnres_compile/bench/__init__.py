"""`attnres-compile bench`: what AttnRes costs, measured side by side in one run.

Each benchmark exposes `run(args, progress) -> dict` (JSON-ready data), `table(data)` and
`plot(data, out_dir)`: kernel.py (the fused kernels against eager, torch.compile, onnxruntime and the
copy-bandwidth roofline), model/ (whole models per runtime), block.py (two-phase against one-pass
Block; history memory), decode/ (per-token decode with a KV cache). timing.py times candidates in
alternating rounds, so drift hits all alike; targets.py holds the targets as data; results.py
writes the JSON, table and PNGs."""
