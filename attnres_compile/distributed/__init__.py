"""Training a rewritten model past one process, on torch.distributed's own engines.

The rewrite returns one flat GraphModule; the engines want modules (FSDP2's `fully_shard` per
block, `torch.utils.checkpoint`), stages (`torch.distributed.pipelining.PipelineStage`) and
sharding rules (DTensor: `dtensor.py`, registered when this package is imported). This package
hands them those, plans what crosses each pipeline hop and what each rank's memory holds
(planner.py); the schedules, collectives and optimizers stay the engines'.
"""

from .blocks import block_names, called_blocks
from .checkpointing import SitePolicy, checkpoint_blocks
from .dtensor import register_dtensor_rules
from .offload import OffloadHistory
from .pipeline import Carried, Hop, StagePlan, split_stages
from .planner import MemoryPlan, plan_memory, plan_traced
from .stage_cache import StageCache, schedule_stage_ranks, seen_before

__all__ = ["Carried", "Hop", "MemoryPlan", "OffloadHistory", "SitePolicy", "StageCache", "StagePlan", "block_names",
           "called_blocks", "checkpoint_blocks", "plan_memory", "plan_traced", "register_dtensor_rules",
           "schedule_stage_ranks", "seen_before", "split_stages"]

register_dtensor_rules()
