"""`attnres-compile bench`: what AttnRes costs, measured side by side in one run.

  kernel.py  the fused TVM kernel against unfused torch eager, torch.compile of it, onnxruntime
             on the ONNX site, and the machine's copy bandwidth (the roofline), over S x T x D
  model.py   whole models (PreNorm GPT, HF Llama), original against Full and Block rewrites,
             in torch eager, onnxruntime and the TVM artifact: latency, peak memory, overhead %
  block.py   Block AttnRes: two-phase against one-pass kernels; history memory of Block vs Full

Each benchmark returns a data dict (JSON-ready) and writes its table and PNG plots through
results.py; timing.py does the interleaved timing that makes ratios trustworthy on a noisy host.
"""
