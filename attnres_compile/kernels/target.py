"""Facts about a TVM target that the kernels' schedules and the model schedules (backends/tvm) both use."""

from __future__ import annotations

from tvm.target import Target
from tvm.target.codegen import llvm_get_vector_width, target_has_features


def vector_bits(target: Target) -> int:
    """The width of the target's vector registers. LLVM's own answer (llvm_get_vector_width)
    reads 512 on x86 CPUs without AVX-512 (znver3): a 16-float vector is then two registers,
    and tiles sized for 32 registers of 512 bits spill on the 16 of 256 bits."""
    if target.kind.name == "llvm" and target_has_features("avx512f", target):
        return 512
    if target.kind.name == "llvm" and target_has_features("avx", target):
        return 256
    width = llvm_get_vector_width(target)
    return width if width > 0 else 128


def cores(target: Target) -> int:
    """Worker threads the target was made for (its num-cores, at least 1)."""
    return max(1, int(target.attrs.get("num-cores", 1)))


def host_target(num_cores: int = 2) -> Target:
    """An llvm target for this machine's CPU with `num_cores` worker threads."""
    mcpu = str(Target.from_device("cpu").attrs["mcpu"])
    return Target({"kind": "llvm", "mcpu": mcpu, "num-cores": num_cores})
