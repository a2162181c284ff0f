"""The torch ops, `torch.ops.attnres.*`: importing this package registers them.

- `depth_attention` (depth_attention.py): one AttnRes site, its backward, the eager reference and
  the observers the monitor collects through;
- `depth_attention_partial` / `depth_attention_merge` (two_phase.py): a site's softmax split at a
  history that several sites share;
- `depth_attention_norm` (site_norm.py): a site fused with the norm that reads it;
- `depth_attention_delta` (delta.py): a Delta AttnRes site, base + gate * the site, its backward and
  its two-phase merge `depth_attention_merge_delta`.
"""

from . import delta, depth_attention, site_norm, two_phase  # noqa: F401
