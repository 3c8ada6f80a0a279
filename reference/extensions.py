"""BEYOND THE LESSON: operations lesson 03's scheduler does not have, written against its state.

Lesson 03 has no way to cancel a request; a server needs one (a client hangs
up, a step fails). It knows one stop token, EOS, where a request may name more:
``postprocess_with_stops`` finishes at those too (ENG-15, spec/optimized-scheduler.md
OPT-24). ``abort`` and ``abort_step`` are stated in spec/abort.md
(ABORT-1..6, FAULT-2) and kept here, outside reference/scheduler.py, so that
the oracle of the lesson stays the lesson statement for statement. Invariants
they keep: every sequence not aborted stays where it was, in its order; an
aborted sequence's blocks are released exactly as ``BlockManager.deallocate``
releases them (reverse table order, a block freed when its last holder lets
go), so they keep their hash and the prefix cache can still hit them; nothing
a failed step computed is registered; a refused call changes nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

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


def postprocess_with_stops(
    scheduler: Scheduler, seqs: list[Sequence], token_ids: list[int], is_prefill: bool,
    stop_token_ids: Iterable[Collection[int]],
) -> None:
    """The lesson's postprocess, plus a rule beside EOS: a sequence that draws one of its stop tokens finishes.

    ``stop_token_ids[i]`` is the stop set of ``seqs[i]``. The lesson's postprocess runs one sequence at a
    time, in batch order (its loop body touches only that sequence, so this is the same postprocess); a
    sequence whose kept token (not the discarded sample of an unfinished chunk) is one of its stop tokens,
    and that EOS or max_tokens did not finish already, is finished right after its own turn, the way the
    lesson finishes one: FINISHED, blocks released, out of ``running``. The free queue therefore receives
    the blocks in batch order, as if EOS had finished it.
    """
    for seq, token_id, stops in zip(seqs, token_ids, stop_token_ids):  # noqa: B905 (as the lesson zips)
        kept = not is_prefill or seq.num_cached_tokens + seq.num_scheduled_tokens >= seq.num_tokens
        scheduler.postprocess([seq], [token_id], is_prefill)
        if kept and token_id in stops and seq.status is SequenceStatus.RUNNING:
            seq.status = SequenceStatus.FINISHED
            scheduler.block_manager.deallocate(seq)
            scheduler.running.remove(seq)
