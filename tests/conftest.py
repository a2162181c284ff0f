"""Shared fixtures."""

import pytest
import torch

from attnres_compile.ops import depth_attention as op_module


@pytest.fixture
def one_thread():
    """Tiny tensors: intra-op threads only add sync overhead (5x slower on a busy 2-core runner)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=["tvm", "eager"])
def kernel(request):
    """The depth-attention ops' implementation for the test: the fused TVM kernels, then the eager reference."""
    previous = op_module.set_kernel(request.param)
    yield request.param
    op_module.set_kernel(previous)
