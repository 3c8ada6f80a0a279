"""Predicates over scheduler state: each returns the violations it finds, naming spec clauses.

Pure Python, no torch. Tests and the engine's ``check=True`` mode call
``check_state`` after every step and ``check_batch`` on every batch; a check that reads only some
blocks (the trace's replay) calls ``check_block_refs`` (INV-2) for each.
"""

from invariants.checks import Violation, check_batch, check_state
from invariants.state import BlockView, SchedulerState, SeqView, seq_view, snapshot
from invariants.state_checks import check_block_refs

__all__ = [
    "BlockView",
    "SchedulerState",
    "SeqView",
    "Violation",
    "check_batch",
    "check_block_refs",
    "check_state",
    "seq_view",
    "snapshot",
]
