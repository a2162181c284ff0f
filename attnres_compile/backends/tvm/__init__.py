"""TVM (TensorIR) backend: the fused depth-attention kernels (forward, backward, two-phase pair) and
their schedules, whole-model lowering (every AttnRes site one kernel call), and deployable
artifacts (`compile_model`, `load`).

The names below load on first use (PEP 562), so that `backends.tvm.cli`, which the command line
imports to build its parser, does not import TVM (~3.5 s of CPU) for commands that never use it."""

import importlib

_HOMES = {
    "Artifact": "runtime",
    "LowerDepthAttention": "lower",
    "build": "schedule",
    "compile_model": "artifact",
    "depth_attention_backward_func": "kernel",
    "depth_attention_func": "kernel",
    "depth_attention_merge_func": "kernel",
    "depth_attention_partial_func": "kernel",
    "host_target": "schedule",
    "load": "runtime",
    "schedule_cpu": "schedule",
    "schedule_cuda": "schedule",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
