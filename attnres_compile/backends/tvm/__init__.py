"""TVM (TensorIR) backend: the fused depth-attention kernels (forward, backward, two-phase pair) and
their schedules, whole-model lowering (every AttnRes site one kernel call), and deployable
artifacts (`compile_model`, `load`)."""

from .artifact import compile_model
from .kernel import (
    depth_attention_backward_func,
    depth_attention_func,
    depth_attention_merge_func,
    depth_attention_partial_func,
)
from .lower import LowerDepthAttention
from .runtime import Artifact, load
from .schedule import build, host_target, schedule_cpu, schedule_cuda

__all__ = [
    "Artifact",
    "LowerDepthAttention",
    "build",
    "compile_model",
    "depth_attention_backward_func",
    "depth_attention_func",
    "depth_attention_merge_func",
    "depth_attention_partial_func",
    "host_target",
    "load",
    "schedule_cpu",
    "schedule_cuda",
]
