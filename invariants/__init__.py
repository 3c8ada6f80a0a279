"""Predicates over scheduler state: each returns the violations it finds, naming spec clauses.

Pure Python, no torch. Tests and the engine's ``check=True`` mode call
``check_state`` after every step and ``check_batch`` on every batch.
"""

from invariants.checks import Violation, check_batch, check_state
from invariants.state import BlockView, SchedulerState, SeqView, seq_view, snapshot

__all__ = [
    "BlockView",
    "SchedulerState",
    "SeqView",
    "Violation",
    "check_batch",
    "check_state",
    "seq_view",
    "snapshot",
]
