"""`attnres-compile bench`: what AttnRes costs, measured side by side in one run.
Each benchmark (kernel.py, model/, block.py, decode/) exposes `run(args, progress) -> dict`,
`table(data)` and `plot(data, out_dir)`; timing.py, targets.py and results.py are shared.
docs/bench.md describes them."""
