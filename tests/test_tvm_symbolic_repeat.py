"""A tensor repeated a symbolic number of times (tile.py) through both TVM importers.

SigLIP's attention-pooling head repeats its probe once per image, `probe.repeat(batch, 1, 1)`,
batch symbolic: its ONNX Tile (counts `Concat(Shape(x)[:1], [1, 1])`) was refused by TVM's importer
("cannot handle ShapeExpr inputs") and its `.pt2` repeat failed in `relax.op.tile`, which takes
integers only. Each build runs at two batch sizes against onnxruntime or torch.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort
import torch
import tvm
import transformers as tf
from tvm import relax

from attnres_compile import AttnResConfig
from attnres_compile.backends.tvm import compile_model, load
from attnres_compile.backends.tvm.importers import import_model
from attnres_compile.backends.tvm.pipeline import build, make_target
from attnres_compile.onnx.pipeline import export_onnx

RTOL = 1e-4  # against onnxruntime / torch, relative to the output's largest magnitude
BATCHES = (2, 3)


class _Probe(torch.nn.Module):
    """A learned probe repeated once per row of the batch, set before the rows (a pooling head's query)."""

    def __init__(self):
        super().__init__()
        self.probe = torch.nn.Parameter(torch.randn(1, 2, 8))

    def forward(self, x):
        return torch.cat([self.probe.repeat(x.shape[0], 1, 1), x], dim=1) * 2


def _run(vm, x: np.ndarray) -> np.ndarray:
    out = vm["main"](tvm.runtime.tensor(x))
    return (out[0] if isinstance(out, tvm.ir.Array) else out).numpy()  # a program returns a tuple


def _close(expected: np.ndarray, actual: np.ndarray) -> None:
    assert actual.shape == expected.shape
    assert np.abs(actual - expected).max() <= RTOL * np.abs(expected).max()


def test_repeat_by_the_batch_in_a_program():
    torch.manual_seed(0)
    model = _Probe().eval()
    program = torch.export.export(model, (torch.randn(2, 5, 8),), dynamic_shapes=({0: torch.export.Dim("b")},))
    vm = relax.VirtualMachine(build(import_model(program), make_target("llvm")).executable, tvm.cpu())
    for b in BATCHES:
        x = torch.randn(b, 5, 8)
        _close(model(x).detach().numpy(), _run(vm, x.numpy()))


def test_tile_by_the_batch_in_an_onnx_file(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "probe.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Probe().eval(), (torch.randn(2, 5, 8),), str(path), dynamo=True, input_names=["x"],
                          dynamic_shapes=({0: torch.export.Dim("b")},))
    vm = relax.VirtualMachine(build(import_model(path), make_target("llvm")).executable, tvm.cpu())
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for b in BATCHES:
        x = np.random.default_rng(b).standard_normal((b, 5, 8)).astype(np.float32)
        _close(session.run(None, {"x": x})[0], _run(vm, x))


def test_siglip_vision_compiles_with_a_symbolic_batch(tmp_path):
    """Tiny HF SigLIP vision tower, Full AttnRes ONNX (batch symbolic), compiled and run at two batch sizes."""
    torch.manual_seed(0)
    config = tf.SiglipVisionConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                   image_size=16, patch_size=8)
    export_onnx(tf.SiglipVisionModel(config).eval(), {"pixel_values": torch.randn(2, 3, 16, 16)},
                tmp_path / "siglip.onnx", AttnResConfig(), verify_outputs=False)
    compile_model(tmp_path / "siglip.onnx", tmp_path / "art", verify_outputs=False)
    artifact = load(tmp_path / "art")
    session = ort.InferenceSession(str(tmp_path / "siglip.onnx"), providers=["CPUExecutionProvider"])
    for b in BATCHES:
        feeds = {"pixel_values": np.random.default_rng(b).standard_normal((b, 3, 16, 16)).astype(np.float32)}
        for expected, actual in zip(session.run(None, feeds), artifact(feeds).values(), strict=True):
            _close(expected, actual)
