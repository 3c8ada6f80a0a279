"""The invariants a replay checks at each step, at a cost independent of the cache's size (TRACE-5).

Invariant: after every ``schedule()`` the replay checks every batch invariant
(INV-12..20, ``check_batch`` whole) and, after every change of state,
INV-2 over the blocks live sequences hold (each exists, and
``invariants.check_block_refs`` holds for it); every ``FULL_EVERY``-th step and
at the end of the trace it checks every state invariant over a full snapshot.
Blocks are read one at a time through the scheduler port's ``BlockReader``
(ARCH-4), so what one step costs grows with the blocks the live sequences hold,
never with ``num_blocks``: a GPU run's cache has millions of blocks, almost all
of them untouched by any one step. The rules are the invariants'; this module
only chooses which blocks they read.
"""

from __future__ import annotations

from typing import Any

from invariants import check_batch, check_state, seq_view, snapshot
from invariants.on_demand import BlocksOnDemand, block_view, held_block_violations, light_state
from invariants.violation import Violation
from optimized.core.port import SchedulerPort

__all__ = ["FULL_EVERY", "BlocksOnDemand", "batch_violations", "block_view", "held_block_violations",
           "light_state", "state_violations"]

FULL_EVERY = 64  # every 64th step (and the end of the trace) checks the whole state from a snapshot


def batch_violations(port: SchedulerPort[Any], batch: list[Any], prefill: bool, full: bool,
                     priorities: dict[int, int] | None = None) -> list[Violation]:
    """Right after ``schedule()``: every batch invariant and INV-2 on the held blocks; with ``full``, every state
    invariant from a snapshot as well. ``priorities``: the live sequences' (seq_id -> priority) under the
    ``priority`` policy, which the light state reads (POLICY-6)."""
    views = [seq_view(s) for s in batch]
    if full:
        state = snapshot(port)
        return check_state(state, between_steps=False) + check_batch(state, views, prefill)
    return held_block_violations(port) + check_batch(light_state(port, priorities=priorities), views, prefill)


def state_violations(port: SchedulerPort[Any], full: bool) -> list[Violation]:
    """Between steps: INV-2 on the held blocks; with ``full``, every state invariant from a snapshot."""
    if full:
        return check_state(snapshot(port), between_steps=True)
    return held_block_violations(port)
