"""TVM (TensorIR) backend: whole-model lowering (every AttnRes site one kernel call) and deployable
artifacts (`compile_model`, `load`); it re-exports the fused depth-attention kernels and their
schedules from attnres_compile.kernels.

The names below load on first use (PEP 562), so that `backends.tvm.cli`, which the command line
imports to build its parser, does not import TVM for commands that never use it."""

from ...utils.lazy import exports

_HOMES = {
    "Artifact": "runtime",
    "LowerDepthAttention": "lower",
    "build": "..kernels.schedule",
    "compile_model": "artifact",
    "depth_attention_backward_func": "..kernels.tensorir",
    "depth_attention_func": "..kernels.tensorir",
    "depth_attention_merge_func": "..kernels.tensorir",
    "depth_attention_partial_func": "..kernels.tensorir",
    "host_target": "..kernels.target",
    "load": "runtime",
    "schedule_cpu": "..kernels.schedule",
    "schedule_cuda": "..kernels.schedule",
}

__all__ = sorted(_HOMES)


__getattr__, __dir__ = exports(__name__, _HOMES)
