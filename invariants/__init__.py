"""Predicates over scheduler state: each returns the violations it finds, naming spec clauses.

Pure Python, no torch. ``check_state`` checks a whole state, ``check_batch`` one batch, each with the clauses of
the state's policy (``policy_checks``, spec/policies.md) and no other's; a check that reads
only some blocks (the trace's replay, check mode between its full comparisons) runs ``check_live`` (the invariants
that read no block) and ``on_demand.check_blocks`` (INV-2, INV-4 per block) over the blocks it chose.
"""

from invariants.checks import Violation, check_batch, check_live, check_state
from invariants.state import BlockView, SchedulerState, SeqView, seq_view, snapshot
from invariants.state_checks import check_block_refs

__all__ = [
    "BlockView",
    "SchedulerState",
    "SeqView",
    "Violation",
    "check_batch",
    "check_block_refs",
    "check_live",
    "check_state",
    "seq_view",
    "snapshot",
]
