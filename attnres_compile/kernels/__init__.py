"""The fused depth-attention kernels, in one home for the torch op, the TVM lowering and the benchmarks.

tensorir.py defines them in TensorIR (forward, backward, two-phase partial and merge), schedule.py
schedules them for CPU and CUDA (target.py: what a target offers, tir_pipeline.py: the TIR
pipeline they compile through), cache.py builds and keeps them (store.py: the trusted disk folder;
prebuild.py: a rewrite's kernels built ahead in worker processes) and fused.py calls them on torch tensors. Nothing here imports the rest of attnres_compile: the op
(ops/depth_attention.py) and backends/tvm import these modules, never the other way round (DEVELOPMENT.md)."""
