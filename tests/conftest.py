"""Shared fixtures."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny tensors: intra-op threads only add sync overhead (5x slower on a busy 2-core runner)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
