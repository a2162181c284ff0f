"""The ONNX frontend and format: files read and written safely (io.py), the site format
(function.py; docs/onnx-format.md), the neutral view (view.py), the passes (rewrite.py,
two_phase.py, site_norm.py, unfuse_skip_norm.py, exact_sigmoid.py), PyTorch export (export.py),
onnxruntime runs (runtime.py), and pipeline.py: inspect_onnx, rewrite_onnx, export_onnx."""
