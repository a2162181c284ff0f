#!/usr/bin/env bash
# The kernel, model and block benchmarks on one CUDA GPU, sized to finish in under 5 minutes.
#
#   benchmarks/gpu.sh [OUT_DIR]        (default bench-results-gpu)
#
# Needs this package installed with a CUDA build of torch, onnxruntime-gpu for the onnxruntime
# column (the CPU wheel has no CUDAExecutionProvider: that column is then recorded as skipped),
# and nvcc on PATH (TVM compiles its CUDA kernels with it). Writes kernel/model/block .json, .txt
# and .png into OUT_DIR and prints each table. The budget: the kernel matrix is the full S x T x D
# in fp32 and fp16 at 3 rounds (torch.compile's one compile per (S, D, dtype) dominates it);
# the model matrix is the full 12/24/48-sublayer matrix with TVM's default build (dlight's GPU
# schedules, no tuning: meta_schedule measures on the CPU only here), against onnxruntime-gpu,
# with the per-kernel / per-node profile beside it. Then every HF model of the suite is built
# for this GPU's arch and run against onnxruntime (benchmarks/tvm_zoo.py --cuda).
set -euo pipefail
out="${1:-bench-results-gpu}"
start=$SECONDS
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
attnres-compile bench kernel --device cuda --rounds 3 --out "$out"
echo "kernel done at $((SECONDS - start)) s" >&2
attnres-compile bench model --device cuda --rounds 3 --profile --out "$out"
echo "model done at $((SECONDS - start)) s" >&2
attnres-compile bench block --device cuda --rounds 3 --out "$out"
echo "block done at $((SECONDS - start)) s" >&2
python "$(dirname "$0")/tvm_zoo.py" --cuda --out "$out/tvm_zoo.json"
echo "all done in $((SECONDS - start)) s: $out" >&2
