"""The torch ops, `torch.ops.attnres.*`: importing this package registers them.

`depth_attention` (one site), `depth_attention_partial` / `depth_attention_merge` (two_phase.py),
`depth_attention_norm` (site_norm.py) and `depth_attention_delta` (delta.py), each with its
backward.
"""

from . import delta, depth_attention, site_norm, two_phase  # noqa: F401
