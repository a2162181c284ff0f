"""A build that fails on symbolic dims says which `--static-shape` flags to try, and they work.

A slice of a padded tensor cut to another slice's symbolic length (`a * b[:, :a.shape[1]]`) built
with symbolic dims fails in TVM's VM code generation ("CodeGenVM cannot emit this Relax operator");
with the dims fixed it builds. The failure's one line names each input's flag.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

from attnres_compile.backends.tvm.importers import import_model
from attnres_compile.backends.tvm.pipeline import build, make_target
from attnres_compile.core.errors import CompileError


class _Trimmed(torch.nn.Module):
    def forward(self, x, y):
        a = x[:, 1:-1] * 2
        b = torch.nn.functional.pad(y, (0, 0, 1, 1))[:, 2:]
        return (a * b[:, :a.shape[1]],)


def test_the_hint_names_flags_that_fix_the_build():
    dims = {0: torch.export.Dim("b"), 1: torch.export.Dim("s", min=4, max=64)}
    x, y = torch.randn(2, 6, 4), torch.randn(2, 6, 4)
    imported = import_model(torch.export.export(_Trimmed(), (x, y), dynamic_shapes=(dims, dims)))
    with pytest.raises(CompileError) as failure:
        build(imported, make_target("llvm"))
    flags = re.findall(r"--static-shape (\w+):(\{\w+\})x(\{\w+\})x4", str(failure.value))
    assert [name for name, *_ in flags] == ["x", "y"], str(failure.value)
    shapes = {name: (2, 6, 4) for name, *_ in flags}  # the sizes to compile for, put in the flags' places
    vm = relax.VirtualMachine(build(imported, make_target("llvm"), input_shapes=shapes).executable, tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(x.numpy()), tvm.runtime.tensor(y.numpy()))
    np.testing.assert_allclose(out[0].numpy(), _Trimmed()(x, y)[0].numpy(), rtol=1e-6)
