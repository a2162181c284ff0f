"""TVM (TensorIR) backend: the fused depth-attention kernel, its schedules and build helpers."""

from .kernel import depth_attention_func, depth_attention_merge_func, depth_attention_partial_func
from .schedule import build, host_target, schedule_cpu, schedule_cuda

__all__ = [
    "build",
    "depth_attention_func",
    "depth_attention_merge_func",
    "depth_attention_partial_func",
    "host_target",
    "schedule_cpu",
    "schedule_cuda",
]
