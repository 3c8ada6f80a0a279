"""The two entry points: ``check_state`` for a scheduler's state, ``check_batch`` for one batch.

Both are pure functions of a ``SchedulerState`` snapshot (and the batch's
``SeqView``s) that return every ``Violation`` found, in clause order, and an
empty list when the state is sound. ``check_state`` holds between steps (after
postprocess) and, with ``between_steps=False``, right after schedule();
``check_batch`` takes the state right after schedule(). Clause ids are those of
spec/invariants.md, and under a policy other than the lesson's (``state.policy``) its own clauses of
spec/policies.md: FIFO order (INV-6) is the lesson's alone, each policy adds its own state clause
(``policy_checks``), and ``mixed`` and ``priority`` place a batch in the queues as they keep them.
"""

from __future__ import annotations

from invariants import batch_checks as b
from invariants import policy_checks as p
from invariants import state_checks as s
from invariants.state import SchedulerState, SeqView
from invariants.violation import Violation

__all__ = ["Violation", "check_batch", "check_live", "check_state"]


def check_state(state: SchedulerState, *, between_steps: bool = True) -> list[Violation]:
    """Every state invariant (INV-1..11, INV-6 under the lesson only) and the policy's own (POLICY-2, 6, 10); pass
    between_steps=False right after schedule()."""
    return [
        *s.check_block_partition(state),
        *s.check_ref_counts(state),
        *s.check_idle(state),
        *s.check_fifo(state),
        *s.check_prefix_table(state),
        *s.check_token_counters(state, between_steps),
        *s.check_queues(state),
        *s.check_block_contents(state),
        *s.check_lengths(state),
        *s.check_running_tables(state),
        *s.check_waiting_tables(state),
        *p.check_policy(state),
    ]


def check_live(state: SchedulerState, *, between_steps: bool = True) -> list[Violation]:
    """The state invariants that read no block, only the live sequences (INV-6..11 and the policy's own): what they
    cost follows the queues, not the cache. The rest of ``check_state`` (INV-1..5) reads blocks."""
    return [
        *s.check_fifo(state),
        *s.check_token_counters(state, between_steps),
        *s.check_queues(state),
        *s.check_lengths(state),
        *s.check_running_tables(state),
        *s.check_waiting_tables(state),
        *p.check_policy(state),
    ]


def check_batch(state: SchedulerState, batch: list[SeqView], is_prefill: bool) -> list[Violation]:
    """Every batch invariant (INV-12..20), given the state right after schedule(); a ``mixed`` step's as
    ``check_mixed_batch`` reads them."""
    if state.policy == "mixed":
        return [
            *b.check_mixed_batch(state, batch, is_prefill),
            *b.check_scheduled_counts(state, batch),
            *b.check_exclusive_writes(state, batch),
            *b.check_progress(state, batch),
            *b.check_coverage(state, batch),
            *b.check_unhashed_writes(state, batch),
        ]
    return [
        *b.check_limits(state, batch, is_prefill),
        *b.check_chunking(state, batch, is_prefill),
        *b.check_decode(batch, is_prefill),
        *b.check_scheduled_counts(state, batch),
        *b.check_exclusive_writes(state, batch),
        *b.check_progress(state, batch),
        *b.check_coverage(state, batch),
        *b.check_unhashed_writes(state, batch),
        *b.check_placement(state, batch, is_prefill),
    ]
