"""Fine-tuning a converted model: optimizer parameter groups and a warm-up for the pseudo-queries.
A converted model's queries get large first gradients, so a usual recipe's first step can wreck
it. `param_groups` puts the queries in a group of their own (scaled learning rate, no weight
decay) and `query_warmup` ramps that group's rate from zero; docs/finetune.md says why and where
the defaults come from.
"""

from .recipe import QUERY_LR_SCALE, SGD_QUERY_LR_SCALE, WARMUP_STEPS, is_query, param_groups, query_warmup

__all__ = ["QUERY_LR_SCALE", "SGD_QUERY_LR_SCALE", "WARMUP_STEPS", "is_query", "param_groups", "query_warmup"]
