"""The Python API, one front door for every format.

torch: `inspect`, `rewrite` (fx/pipeline.py), `two_phase`, `fuse_norms` (passes on a rewritten
GraphModule); `convert` (a Hugging Face causal LM, or any nn.Module, converted as a model of its own
class: Trainer, PEFT, bf16, save_pretrained; hf/) and `load` (its saved folder, hf/checkpoint.py);
ONNX files: `inspect_onnx`, `rewrite_onnx`; PyTorch to a deployable file: `export_onnx`
(onnx/pipeline.py), `export_pt2` (pt2/export.py)."""

from .core.report import ExportResult, Report
from .fx.pipeline import RewriteResult, inspect, inspect_traced, rewrite
from .fx.site_norm import fuse_norms
from .fx.two_phase import two_phase
from .hf import convert, load
from .onnx.pipeline import export_onnx, inspect_onnx, rewrite_onnx
from .pt2.export import export_pt2

__all__ = ["ExportResult", "Report", "RewriteResult", "convert", "export_onnx", "export_pt2", "fuse_norms", "inspect",
           "inspect_onnx", "inspect_traced", "load", "rewrite", "rewrite_onnx", "two_phase"]
