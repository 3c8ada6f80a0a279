"""The reference scheduler as the scheduler tests build it: one helper instead of a copy per test module."""

from __future__ import annotations

from reference import Scheduler, SchedulerConfig


def make_scheduler(num_blocks: int, *, block_size: int = 4, max_num_seqs: int = 8, budget: int = 64,
                   eos: int = -1) -> Scheduler:
    """A reference scheduler over ``num_blocks`` blocks; ``budget`` is max_num_batched_tokens, and eos -1 (no token
    id) means no request stops early. A module with other defaults binds them once:
    ``make = partial(make_scheduler, eos=9)``."""
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=budget, eos=eos))
