"""The optimized scheduler: the reference's decisions, with decode costing O(events) Python per step.

Invariants: ``waiting`` then ``running`` hold every unfinished sequence once,
in the reference's order; the decode group's members are a prefix of
``running`` (decode_group.py); every decision - which sequences run, how many
tokens each, which block ids, who is preempted, who finishes, what enters the
prefix cache - is the one lesson 03's scheduler makes (spec/optimized-scheduler.md
argues each clause, OPT-1..). The prefill loop is the reference's loop on
cached hashes. A decode step does per-sequence work only for sequences with an
event this step (a fresh block, a full block to hash, a finish, a preemption);
the rest of the batch is advanced by the group's clock and one numpy scatter.
Where the reference's ``assert scheduled_seqs`` fires, ``EmptyDecodeError``
is raised with the state the reference leaves: every preempted sequence back
at the front of ``waiting``, ``running`` empty (OPT-9). It satisfies the
scheduler port (port.py, ARCH-4) as it is: its consumers need no adapter.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Collection
from typing import Any

import numpy as np

from invariants.block_math import prefill_grant
from invariants.state import BlockView, SchedulerState, seq_view
from optimized.core.config import SchedulerConfig
from optimized.core.decode_group import DecodeGroup
from optimized.core.errors import (
    EmptyDecodeError,
    int64_tokens,
    is_step_batch,
    refuse_a_second_schedule,
    stop_set,
    strict_int,
)
from optimized.core.kv_cache_manager import KVCacheManager
from optimized.core.port import ScheduleOutput
from optimized.core.sequence import I64, Sequence, SequenceParams, SequenceStatus
from optimized.core.token_arena import TokenArena

__all__ = ["ScheduleOutput", "Scheduler", "SchedulerConfig", "Sequence", "SequenceStatus"]

RUNNING = SequenceStatus.RUNNING
WAITING = SequenceStatus.WAITING
FINISHED = SequenceStatus.FINISHED


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.eos = config.eos
        self.block_size = config.block_size
        self.block_manager = KVCacheManager(config.num_blocks, config.block_size)
        self._group = DecodeGroup(config.block_size)
        self._arena = TokenArena(on_move=self._group.refresh_positions)
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        # The batch of the step that awaits its postprocess or abort_step, as schedule() returned it, whatever the
        # caller does to the list (empty: no step awaits), and the list it returned (the group's fast path takes it).
        self._step_batch: list[Sequence] = []
        self._last_batch: list[Sequence] | None = None

    # --- the scheduler port (ARCH-4): the lesson's API and more ---------------------------------
    @property
    def waiting(self) -> deque[Sequence]:
        """The waiting queue, front first (read it; do not modify it)."""
        return self._waiting

    @property
    def running(self) -> list[Sequence]:
        """The running queue, front first (read it; do not modify it)."""
        return self._running

    @property
    def blocks(self) -> KVCacheManager:
        """The KV-cache blocks, one at a time (the port's ``BlockReader``)."""
        return self.block_manager

    def is_finished(self) -> bool:
        return not self._waiting and not self._running

    def new_sequence(self, token_ids: list[int] | I64, max_tokens: int, ignore_eos: bool = False,
                     temperature: float = 1.0) -> Sequence:
        """A sequence of this scheduler's block size (the engine makes its own from its ``SamplingParams``)."""
        return Sequence(token_ids, SequenceParams(temperature, max_tokens, ignore_eos), self.block_size)

    def add(self, seq: Sequence, stop_token_ids: Collection[int] = (), priority: int = 0) -> None:
        """Queue a new sequence; ValueError (and no change) when it cannot be one of ours.

        ``stop_token_ids``: drawing one of these finishes the sequence, beside EOS (OPT-24). ``priority`` must be
        an int; the lesson's policy orders by arrival alone, so it reads nothing more of it (the ``priority``
        policy does).
        """
        strict_int(priority, "priority")
        self._check_new(seq)
        self._queue(seq, stop_token_ids)

    def _check_new(self, seq: Sequence) -> None:
        """ValueError, nothing changed, unless ``seq`` is a fresh sequence of this scheduler's block size."""
        if not isinstance(seq, Sequence):
            raise ValueError(f"seq must be an optimized Sequence, got {type(seq).__name__}")
        if seq.block_size != self.block_size:
            raise ValueError(f"seq.block_size {seq.block_size} differs from the scheduler's {self.block_size}")
        core = seq.core
        if core.arena is not None or core.own is None or core.status is not WAITING or seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} was already added to a scheduler")
        strict_int(core.max_tokens, "max_tokens", 1)

    def _queue(self, seq: Sequence, stop_token_ids: Collection[int]) -> None:
        """Place a checked sequence's tokens in the arena and append it to ``waiting``; ValueError, nothing
        changed, for a bad stop set."""
        core, own = seq.core, seq.core.own
        assert own is not None  # _check_new refused a sequence without its own tokens
        core.stops = stop_set(stop_token_ids)
        self._arena.place(core, own, seq.num_prompt_tokens + core.max_tokens)
        core.arena = self._arena
        core.own = None
        self._waiting.append(seq)

    def schedule(self) -> ScheduleOutput[Sequence]:
        """The lesson's schedule(); RuntimeError, nothing changed, while the last batch awaits its postprocess or
        abort_step (OPT-27)."""
        refuse_a_second_schedule(self._step_batch)
        out = self._prefill() if self._waiting else None
        if out is None:  # a decode: its batch is a copy of the members, which stay as they are until postprocess
            return self._awaiting(self._decode(), self._group.members)
        return self._awaiting(out, out.batch[:])

    def _awaiting(self, out: ScheduleOutput[Sequence], record: list[Sequence]) -> ScheduleOutput[Sequence]:
        """``out``, its batch now the step that awaits its postprocess; ``record`` holds the batch's sequences in
        order, in a list the caller cannot reach."""
        self._last_batch, self._step_batch = out.batch, record
        return out

    def postprocess(self, seqs: list[Sequence], token_ids: Any, is_prefill: bool) -> list[Sequence]:
        """The lesson's postprocess; the sequences it finished, in batch order (OPT-22).

        RuntimeError, nothing changed, for a non-empty batch when no step awaits one; ValueError, nothing
        changed, for a batch that is not the awaiting step's (the running queue itself never is: it changes
        under the loop), fewer tokens than sequences or one that is not an int64 integer: each schedule() is
        postprocessed once (OPT-23), and its step awaits until a postprocess returns.
        """
        if not is_step_batch(seqs, self._step_batch):
            return []
        if seqs is self._running:
            raise ValueError("postprocess: seqs must be the batch the last schedule() returned, not the running "
                             "queue")
        finished = self._postprocess_step(seqs, int64_tokens(token_ids, len(seqs)), is_prefill)
        self._step_batch, self._last_batch = [], None
        return finished

    def _postprocess_step(self, seqs: list[Sequence], tokens: I64, is_prefill: bool) -> list[Sequence]:
        """The step's batch, checked, and a token for each, read: through the group (the very list of a decode
        step), or one sequence at a time (a copy of it, or a prefill step, whose batch holds no member)."""
        group = self._group
        if group.inflight:  # a decode step: the batch is the members, in order (checked)
            if seqs is self._last_batch:
                return self._postprocess_group(tokens)
            group.dissolve()
        return self._postprocess_each(seqs, tokens.tolist(), is_prefill)

    # --- beyond the lesson: abort (spec/abort.md, OPT-19..21) ---------------------------------------
    def abort(self, seq: Sequence) -> None:
        """Take a waiting or running sequence back between steps; its blocks are released as deallocate does.

        ValueError (nothing changed) when ``seq`` is not waiting or running here; RuntimeError (nothing
        changed) between schedule() and postprocess().
        """
        if not isinstance(seq, Sequence) or seq.core.arena is not self._arena or seq.core.status is FINISHED:
            status = seq.status.name if isinstance(seq, Sequence) else type(seq).__name__
            raise ValueError(f"abort: seq {getattr(seq, 'seq_id', '?')} is not waiting or running here ({status})")
        if self._step_in_progress():
            raise RuntimeError("abort: only between steps (a step is scheduled and not yet postprocessed)")
        self._abort(seq)

    def abort_step(self, batch: list[Sequence]) -> None:
        """FAULT-2: the step that scheduled ``batch`` failed before postprocess; withdraw it, abort its members.

        ValueError, and nothing changed, unless ``batch`` is exactly the scheduled sequences, each once.
        """
        scheduled = [s for s in (*self._waiting, *self._running) if s.num_scheduled_tokens]
        ids = [id(s) for s in batch]
        if len(set(ids)) != len(ids) or set(ids) != {id(s) for s in scheduled}:
            raise ValueError("abort_step: batch must be exactly the sequences the last schedule() returned")
        self._group.inflight = False  # the members' grant of one token is withdrawn
        for seq in batch:
            seq.core.nsched = 0
        self._step_batch, self._last_batch = [], None
        for seq in batch:
            self._abort(seq)

    def _step_in_progress(self) -> bool:
        if self._group.inflight:
            return True
        waiting, running = self._waiting, self._running
        return any(s.core.nsched for s in waiting) or any(s.core.nsched for s in running if s.core.group is None)

    def _abort(self, seq: Sequence) -> None:
        core = seq.core
        if core.status is WAITING:
            self._waiting.remove(seq)  # deque.remove compares with ==, which for Sequence is identity
        else:
            running = self._running
            j = running.index(seq)
            if core.group is not None:
                group = self._group
                group.settle(seq)
                group.remove_at([j])  # members are running's prefix: the same index
            del running[j]
        self.block_manager.forget_walk(seq)
        self._finish(seq)
        core.nsched = 0

    # --- lesson §2: the prefill loop, on cached hashes ------------------------------------------
    def _prefill(self) -> ScheduleOutput[Sequence] | None:
        scheduled: list[Sequence] = []
        num_batched_tokens = 0
        hit_blocks = query_tokens = 0
        waiting, bm, block_size = self._waiting, self.block_manager, self.block_size
        while waiting and len(scheduled) < self.max_num_seqs:
            seq = waiting[0]
            core = seq.core
            remaining = self.max_num_batched_tokens - num_batched_tokens
            if remaining == 0:
                break
            num_cached_blocks = 0
            if not seq.block_table:
                num_cached_blocks = bm.can_allocate(seq)
                if num_cached_blocks == -1:
                    break
                num_tokens = core.ntok - num_cached_blocks * block_size
            else:
                num_tokens = core.ntok - core.ncached
            grant = prefill_grant(num_tokens, remaining, not scheduled)
            if grant == 0:  # only the first sequence of a batch may be chunked
                break
            if not seq.block_table:
                bm.allocate(seq, num_cached_blocks)
                hit_blocks += num_cached_blocks
                query_tokens += core.ntok
            core.nsched = grant
            num_batched_tokens += grant
            if core.ncached + grant == core.ntok:
                core.status = RUNNING
                waiting.popleft()
                self._running.append(seq)
            scheduled.append(seq)
        if not scheduled:
            return None
        return ScheduleOutput(scheduled, True, (), hit_blocks * block_size, query_tokens)

    # --- lesson §4: the decode loop, as one group ----------------------------------------------
    def _decode(self) -> ScheduleOutput[Sequence]:
        preempted, _ = self._decode_members()
        members = self._group.members
        if not members:
            raise EmptyDecodeError("schedule(): nothing fits and nothing is running (the reference's assert)")
        self._group.inflight = True
        return ScheduleOutput(members[:], False, preempted, 0)

    def _decode_members(self) -> tuple[tuple[Sequence, ...], bool]:
        """The lesson's decode loop over ``running[:max_num_seqs]``, the group's members: who it preempted, and
        whether some member found the free queue empty (under ``mixed``, a prefill losing its chunks counts)."""
        group, running = self._group, self._running
        members = group.members
        k = min(len(running), self.max_num_seqs)
        if len(members) < k:
            group.join(running[len(members) : k], keep_segments=bool(self.block_manager.pending))
        phase = group.needing_blocks(group.now)
        due = group.phases[phase]
        if not due:
            return (), False
        bm = self.block_manager
        if len(due) <= bm.free.count:  # OPT-4: nobody has to be preempted
            # list.append over the members' tables at C speed (it returns None, so any() runs to the end).
            any(map(list.append, group.tables[phase], bm.take_fresh_many(len(due))))
            return (), False
        return self._decode_with_preemption(due[:]), True

    def _decode_with_preemption(self, due: list[Sequence]) -> tuple[Sequence, ...]:
        """The reference's popleft / can_append / preempt-the-tail loop, visiting only members that need a block.

        Members before a needy one pass can_append without taking anything; the
        queue's tail (index t-1) is what ``running.pop()`` would take (OPT-5). Returns the preempted,
        in the order they were preempted.
        """
        group, running, bm = self._group, self._running, self.block_manager
        members, free = group.members, bm.free
        t = len(running)
        preempted: list[Sequence] = []
        for seq in due:
            j = members.index(seq)
            if j >= t:
                break
            while free.count == 0:
                if self._release_before_preempting():
                    continue
                if t - 1 > j:
                    t -= 1
                    preempted.append(running[t])
                    self._preempt(running[t])
                else:  # only this one is left: it preempts itself
                    t = j
                    preempted.append(seq)
                    self._preempt(seq)
                    break
            else:
                seq.block_table.append(bm.take_fresh())
                continue
            break
        del running[t:]
        group.truncate(min(t, len(members)))
        return tuple(preempted)

    def _release_before_preempting(self) -> bool:
        """A decode needs a block and none is free: let a table go without preempting a running sequence, if the
        policy has one to give; True when it did (the loop then reads the free count again). The lesson has none to
        give: it never decodes beside a prefill that holds blocks. The ``mixed`` policy's hook (a prefill cut short
        loses its chunks first, POLICY-3)."""
        return False

    def _preempt(self, seq: Sequence) -> None:
        core = seq.core
        if core.group is not None:
            self._group.settle(seq)
        core.status = WAITING
        core.is_prefill = True
        self.block_manager.deallocate(seq)
        self._waiting.appendleft(seq)

    # --- lesson §5: postprocess ----------------------------------------------------------------
    def _postprocess_group(self, tokens: I64) -> list[Sequence]:
        group = self._group
        # One scatter appends a token to every member; the clock advances them all.
        clock = group.now
        shift = clock - group.base_clock  # positions are those of clock base_clock: shift the arena instead
        data = self._arena.data
        (data[shift:] if shift else data)[group.positions] = tokens
        group.now = clock + 1
        group.inflight = False
        filled = group.filling(clock)
        if filled:  # hash_blocks for the members whose last block just filled (registered at the next flush)
            self.block_manager.defer_fills(clock, filled[:])
        finishing = group.finishes.pop(clock, None)
        if group.eos_watchers:
            finishing = self._eos_hits(tokens, finishing)
        if group.stop_ids:
            finishing = self._stop_hits(tokens, finishing)
        if not finishing:
            return []
        self._finish_members(finishing)
        return finishing

    def _eos_hits(self, tokens: I64, finishing: list[Sequence] | None) -> list[Sequence] | None:
        hits = np.flatnonzero(tokens == self.eos)
        if not hits.size:
            return finishing
        members = self._group.members
        return _merged(finishing, [members[j] for j in hits.tolist() if not members[j].ignore_eos])

    def _stop_hits(self, tokens: I64, finishing: list[Sequence] | None) -> list[Sequence] | None:
        """OPT-24: members whose drawn token is one of their own stop tokens finish, as at EOS."""
        watched = self._group.stop_ids
        if len(watched) <= 4:
            mask = functools.reduce(np.logical_or, [tokens == t for t in watched])
        else:
            mask = np.isin(tokens, np.fromiter(watched, dtype=np.int64, count=len(watched)))
        hits = np.flatnonzero(mask)
        if not hits.size:
            return finishing
        members, drawn = self._group.members, tokens[hits].tolist()
        return _merged(finishing, [members[j] for j, t in zip(hits.tolist(), drawn, strict=True)
                                   if t in members[j].core.stops])

    def _finish_members(self, finishing: list[Sequence]) -> None:
        """Finish members in batch order: the free queue receives their blocks in the reference's order."""
        group, running = self._group, self._running
        members = group.members
        indices = [members.index(seq) for seq in finishing]
        for seq in finishing:
            group.settle(seq)
            self._finish(seq)
        group.remove_at(indices)
        for j in reversed(indices):
            del running[j]

    def _finish(self, seq: Sequence) -> None:
        core = seq.core
        core.status = FINISHED
        self.block_manager.deallocate(seq)
        core.own = self._arena.release(core)
        core.arena = None

    def _postprocess_each(self, seqs: list[Sequence], token_ids: list[int], is_prefill: bool) -> list[Sequence]:
        bm, eos, data = self.block_manager, self.eos, self._arena.data
        finished: list[Sequence] = []
        for seq, token_id in zip(seqs, token_ids, strict=True):
            bm.hash_blocks(seq)
            core = seq.core
            core.ncached += core.nsched
            core.nsched = 0
            if is_prefill and core.ncached < core.ntok:
                continue  # an unfinished chunk: its sample is discarded
            data[core.region_offset + core.ntok] = token_id
            core.ntok += 1
            if (
                (not seq.ignore_eos and token_id == eos)
                or core.ntok - seq.num_prompt_tokens == core.max_tokens
                or (core.stops and token_id in core.stops)  # OPT-24: beside EOS
            ):
                self._running.remove(seq)
                self._finish(seq)
                finished.append(seq)
        return finished

    # --- one view for the invariants ------------------------------------------------------------
    def snapshot(self) -> SchedulerState:
        bm = self.block_manager
        bm.flush()
        refs = bm.ref_counts
        return SchedulerState(
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            blocks=[BlockView(b, refs[b], bm.block_hash(b), bm.token_ids_of(b))
                    for b in range(bm.num_blocks)],
            free_block_ids=bm.free_block_ids,
            used_block_ids=bm.used_block_ids,
            hash_to_block_id=bm.hash_to_block_id,
            waiting=[seq_view(s) for s in self._waiting],
            running=[seq_view(s) for s in self._running],
            extra={"decode_clock": self._group.now, "decode_group": len(self._group.members)},
            **self.policy_state(),
        )

    def policy_state(self) -> dict[str, Any]:
        """The ``SchedulerState`` fields of this scheduler's policy (the port's; a policy adds its own): the
        lesson's keeps nothing beyond the queues and the blocks."""
        return {"policy": "lesson"}


def _merged(finishing: list[Sequence] | None, stopped: list[Sequence]) -> list[Sequence] | None:
    """The members finishing this step, in member order, each once."""
    if not stopped:
        return finishing
    merged = {id(s): s for s in (*(finishing or ()), *stopped)}
    return sorted(merged.values(), key=_group_order)


def _group_order(seq: Sequence) -> int:
    return seq.core.gord
