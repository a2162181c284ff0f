"""train()/eval() for GraphModules from `ExportedProgram.module()`, which refuses both: they rewrite
the mode argument of the recorded dropout and batch norm ops, so fine-tuning gets real dropout.
"""

from __future__ import annotations

import types

import torch
from torch import fx, nn

aten = torch.ops.aten
MODE_ARG = {aten.dropout.default: 2, aten.batch_norm.default: 5}


def make_mode_switchable(gm: fx.GraphModule, training: bool) -> fx.GraphModule:
    """Give `gm` working train()/eval() methods; it starts in mode `training`."""

    def train(self, mode: bool = True):
        for node in self.graph.nodes:
            index = MODE_ARG.get(node.target)
            if index is not None and len(node.args) > index:
                node.update_arg(index, bool(mode))
        self.recompile()
        return nn.Module.train(self, mode)

    gm.train = types.MethodType(train, gm)
    gm.eval = types.MethodType(lambda self: self.train(False), gm)
    nn.Module.train(gm, training)
    return gm
