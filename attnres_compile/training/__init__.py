"""Fine-tuning a converted model: optimizer parameter groups and a warm-up for the pseudo-queries.

A converted pretrained model starts exactly where the original stood, but its pseudo-queries get
large first gradients (in preserve scale a site's output is c·Σ p_k s_k with c the source count,
and a pretrained stream is large), so one step of a usual fine-tuning recipe moves the depth
weights far from uniform and can wreck the model. `param_groups` puts the queries in a group of
their own (scaled learning rate, no weight decay) and `query_warmup` ramps that group's rate
from zero; docs/finetune.md has the measurements the defaults come from.
"""

from .recipe import QUERY_LR_SCALE, SGD_QUERY_LR_SCALE, WARMUP_STEPS, is_query, param_groups, query_warmup

__all__ = ["QUERY_LR_SCALE", "SGD_QUERY_LR_SCALE", "WARMUP_STEPS", "is_query", "param_groups", "query_warmup"]
