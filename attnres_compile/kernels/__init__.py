"""The fused depth-attention kernels, in one home for the torch op, the TVM lowering and the benchmarks.
tensorir.py defines them, schedule.py schedules them, cache.py builds and keeps them, fused.py
calls them on torch tensors. Nothing here imports the rest of attnres_compile (DEVELOPMENT.md)."""
