"""The torch.fx frontend: tracing (trace.py, with dynamic dims, HF experts and the decoder-with-past
form), the neutral view of a GraphModule (view.py), the passes that rewrite it (rewrite.py,
two_phase.py, site_norm.py), the lean copy for decode steps (lean.py), and pipeline.py, the rewrite
as a list of passes."""
