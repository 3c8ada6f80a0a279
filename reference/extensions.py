"""BEYOND THE LESSON: operations lesson 03's scheduler does not have, written against its state.

Lesson 03 has no way to cancel a request; a server needs one (a client hangs
up, a step fails). ``abort`` and ``abort_step`` are stated in spec/abort.md
(ABORT-1..6, FAULT-2) and kept here, outside reference/scheduler.py, so that
the oracle of the lesson stays the lesson statement for statement. Invariants
they keep: every sequence not aborted stays where it was, in its order; an
aborted sequence's blocks are released exactly as ``BlockManager.deallocate``
releases them (reverse table order, a block freed when its last holder lets
go), so they keep their hash and the prefix cache can still hit them; nothing
a failed step computed is registered; a refused call changes nothing.
"""

from __future__ import annotations

from reference.scheduler import Scheduler
from reference.sequence import Sequence, SequenceStatus


def _live(scheduler: Scheduler) -> list[Sequence]:
    return [*scheduler.waiting, *scheduler.running]


def abort(scheduler: Scheduler, seq: Sequence) -> None:
    """ABORT-1..4: take ``seq`` out of ``waiting`` or ``running``, release its blocks, mark it FINISHED.

    Only between steps. ValueError, and nothing changed, when ``seq`` is neither waiting nor running in
    ``scheduler`` (never added, already finished or aborted); RuntimeError, and nothing changed, when a
    step is in progress (a sequence is scheduled and not yet postprocessed), as the optimized scheduler.
    """
    in_waiting = any(s is seq for s in scheduler.waiting)
    if not in_waiting and not any(s is seq for s in scheduler.running):
        raise ValueError(f"abort: seq {seq.seq_id} is not waiting or running (status {seq.status.name})")
    if any(s.num_scheduled_tokens for s in _live(scheduler)):
        raise RuntimeError("abort: only between steps (a step is scheduled and not yet postprocessed)")
    # deque.remove compares with ==, which for Sequence is identity.
    (scheduler.waiting if in_waiting else scheduler.running).remove(seq)
    scheduler.block_manager.deallocate(seq)
    seq.status = SequenceStatus.FINISHED


def abort_step(scheduler: Scheduler, batch: list[Sequence]) -> None:
    """FAULT-2: the step that scheduled ``batch`` failed before postprocess; withdraw it and abort its members.

    Every member's grant goes back to 0 without postprocess (nothing hashed, nothing appended), which is a
    between-steps state; then each member is aborted, in batch order. ValueError, and nothing changed,
    unless ``batch`` names exactly the scheduled sequences, each once.
    """
    scheduled = [s for s in _live(scheduler) if s.num_scheduled_tokens]
    ids = [id(s) for s in batch]
    if len(set(ids)) != len(ids) or set(ids) != {id(s) for s in scheduled}:
        raise ValueError("abort_step: batch must be exactly the sequences the last schedule() returned")
    for seq in batch:
        seq.num_scheduled_tokens = 0
    for seq in batch:
        abort(scheduler, seq)
