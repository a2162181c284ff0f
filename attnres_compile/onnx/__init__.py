"""The ONNX frontend and format: safe file I/O, the site format (docs/onnx-format.md), the neutral
view, the rewrite passes, PyTorch export, onnxruntime runs, and pipeline.py's API."""
