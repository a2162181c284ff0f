"""Training a rewritten model past one process, on torch.distributed's own engines.
This package hands FSDP2, checkpointing, pipelining and DTensor the modules, stages and sharding
rules they want (dtensor.py registers on import) and plans hops and memory (planner.py); the
schedules, collectives and optimizers stay the engines' (docs/distributed.md).
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
