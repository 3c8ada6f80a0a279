"""The oracle: lesson 03's scheduler and the block manager it stands on, in pure Python."""

from reference.block_manager import Block, BlockManager, compute_hash
from reference.config import SchedulerConfig
from reference.scheduler import Scheduler
from reference.sequence import SamplingParams, Sequence, SequenceStatus

__all__ = [
    "Block",
    "BlockManager",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "Sequence",
    "SequenceStatus",
    "compute_hash",
]
