"""The invariants a replay checks at each step, at a cost independent of the cache's size (TRACE-5).

Invariant: after every ``schedule()`` the replay checks every batch invariant
(INV-12..20, ``check_batch`` whole) and, after every change of state,
the policy's own clauses (they read no block; POLICY-6 with the priorities
the trace recorded) and INV-2 over the blocks live sequences hold (each exists, and
``invariants.check_block_refs`` holds for it); every ``FULL_EVERY``-th step and
at the end of the trace it checks every state invariant over a full snapshot.
Blocks are read one at a time through the scheduler port's ``BlockReader``
(ARCH-4), so what one step costs grows with the blocks the live sequences hold,
never with ``num_blocks``: a GPU run's cache has millions of blocks, almost all
of them untouched by any one step. The rules are the invariants'; this module
only chooses which blocks they read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from invariants import SchedulerState, check_batch, check_state, seq_view, snapshot
from invariants.on_demand import BlocksOnDemand, block_view, held_block_violations, light_state
from invariants.policy_checks import check_policy
from invariants.violation import Violation
from optimized.core.port import SchedulerPort

__all__ = ["FULL_EVERY", "BlocksOnDemand", "batch_violations", "block_view", "held_block_violations",
           "light_state", "state_violations"]

FULL_EVERY = 64  # every 64th step (and the end of the trace) checks the whole state from a snapshot


def _recorded(state: SchedulerState, priorities: dict[int, int] | None) -> SchedulerState:
    """``state`` with the priorities the trace recorded in place of those the implementation reports (POLICY-16):
    the clause is judged against what each request was added with, never against the judged side's own word."""
    return state if priorities is None else dataclasses.replace(state, priorities=dict(priorities))


def batch_violations(port: SchedulerPort[Any], batch: list[Any], prefill: bool, full: bool,
                     priorities: dict[int, int] | None = None) -> list[Violation]:
    """Right after ``schedule()``: every batch invariant, the policy's own clauses (POLICY-2, 6, 10: they read no
    block) and INV-2 on the held blocks; with ``full``, every state invariant from a snapshot as well.
    ``priorities``: the live sequences' (seq_id -> priority) as recorded, under the ``priority`` policy (POLICY-6
    reads them)."""
    views = [seq_view(s) for s in batch]
    if full:
        state = _recorded(snapshot(port), priorities)
        return check_state(state, between_steps=False) + check_batch(state, views, prefill)
    light = light_state(port, priorities=priorities)
    return held_block_violations(port) + check_policy(light) + check_batch(light, views, prefill)


def state_violations(port: SchedulerPort[Any], full: bool,
                     priorities: dict[int, int] | None = None) -> list[Violation]:
    """Between steps: INV-2 on the held blocks and the policy's own clauses; with ``full``, every state invariant
    from a snapshot. ``priorities`` as ``batch_violations``'."""
    if full:
        return check_state(_recorded(snapshot(port), priorities), between_steps=True)
    return held_block_violations(port) + check_policy(light_state(port, priorities=priorities))
