"""The reference scheduler behind the scheduler port (ARCH-4): a thin adapter, so the lesson keeps its signatures.

Invariant: every decision is the lesson's own code (``reference.Scheduler``)
or ``reference.extensions`` (abort, the failed step, stop tokens), called
unchanged; the adapter only reports what the lesson's signatures do not
return, read off its queues: whom a step preempted (the running sequences
that are waiting after it, the queue's tail first, as the lesson pops them),
its prefix-cache hits, whom a postprocess finished. The lesson's ``assert
scheduled_seqs`` becomes the port's one ``EmptyDecodeError``, and only that
assert: an ``AssertionError`` raised anywhere but in ``schedule()`` itself (the
block manager's), or leaving anything running, propagates as it is.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections import deque
from collections.abc import Collection
from typing import Any

import reference
from invariants import SchedulerState, snapshot
from invariants.state import policy_fields
from optimized.core.config import SchedulerConfig
from optimized.core.errors import int64_tokens, is_step_batch, refuse_a_second_schedule, stop_set, strict_int
from optimized.core.port import EmptyDecodeError, ScheduleOutput
from reference import extensions
from reference.lpm_scheduler import LpmScheduler
from reference.mixed_scheduler import MixedScheduler
from reference.priority_scheduler import PriorityScheduler

WAITING = reference.SequenceStatus.WAITING
FINISHED = reference.SequenceStatus.FINISHED

# policy -> its reference (lpm's takes the config's patience too).
REFERENCES: dict[str, type[reference.Scheduler]] = {
    "lesson": reference.Scheduler, "mixed": MixedScheduler, "priority": PriorityScheduler, "lpm": LpmScheduler}


def _is_empty_decode(error: AssertionError, lesson: reference.Scheduler) -> bool:
    """The assert ``schedule()`` itself raised (not one of the block manager's), leaving ``running`` empty: the
    lesson's ``assert scheduled_seqs``, whether it fired after preempting everyone or on an empty scheduler."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].name == "schedule" and not lesson.running


class ReferenceBlocks:
    """The lesson's block manager read one block at a time (the port's ``BlockReader``)."""

    def __init__(self, block_manager: reference.BlockManager) -> None:
        self._bm = block_manager

    @property
    def num_blocks(self) -> int:
        return len(self._bm.blocks)

    @property
    def num_free(self) -> int:
        return len(self._bm.free_block_ids)

    @property
    def free_block_ids(self) -> list[int]:
        return list(self._bm.free_block_ids)

    @property
    def hash_to_block_id(self) -> dict[int, int]:
        return dict(self._bm.hash_to_block_id)

    def is_used(self, block_id: int) -> bool:
        return block_id in self._bm.used_block_ids

    def ref_count(self, block_id: int) -> int:
        return self._bm.blocks[block_id].ref_count

    def block_hash(self, block_id: int) -> int:
        return self._bm.blocks[block_id].hash

    def token_ids_of(self, block_id: int) -> list[int]:
        return list(self._bm.blocks[block_id].token_ids)


class ReferencePort:
    """``reference.Scheduler`` as a ``SchedulerPort[reference.Sequence]``.

    ``lesson`` is the scheduler class to drive: by default the reference of ``config.policy`` (the lesson's, or a
    policy's beside it in reference/), or a test's variant of one (a mutant whose decisions a replay must tell
    apart). ``lesson_scheduler`` is the instance, for a test to look inside.
    """

    def __init__(self, config: SchedulerConfig, lesson: type[reference.Scheduler] | None = None) -> None:
        self.config = config
        lesson_config = reference.SchedulerConfig(
            num_blocks=config.num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, eos=config.eos)
        if lesson is not None:
            self.lesson_scheduler = lesson(lesson_config)
        elif config.policy == "lpm":
            self.lesson_scheduler = LpmScheduler(lesson_config, config.patience)
        else:
            self.lesson_scheduler = REFERENCES[config.policy](lesson_config)
        self.blocks = ReferenceBlocks(self.lesson_scheduler.block_manager)
        self._stops: dict[int, frozenset[int]] = {}  # seq_id -> its stop set, for the sequences that have one
        self._added: set[int] = set()  # the seq_ids ever added: a second add is refused, as the optimized one does
        # As the optimized scheduler's: the batch of the step that awaits its one postprocess (OPT-23), as
        # schedule() returned it; empty when none does.
        self._step_batch: list[reference.Sequence] = []

    @property
    def waiting(self) -> deque[reference.Sequence]:
        return self.lesson_scheduler.waiting

    @property
    def running(self) -> deque[reference.Sequence]:
        return self.lesson_scheduler.running

    def new_sequence(self, token_ids: list[int], max_tokens: int, ignore_eos: bool = False,
                     temperature: float = 1.0) -> reference.Sequence:
        params = reference.SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=ignore_eos)
        return reference.Sequence(list(token_ids), params, self.config.block_size)

    def is_finished(self) -> bool:
        return self.lesson_scheduler.is_finished()

    def add(self, seq: reference.Sequence, stop_token_ids: Collection[int] = (), priority: int = 0) -> None:
        """The lesson's add; a stop set is honoured by ``extensions.postprocess_with_stops`` (OPT-24), a priority
        handed to the ``priority`` policy's add. The port's refusals first (the lesson takes anything): a
        sequence added before, ``max_tokens`` below 1, a stop id that is not an int64 integer, a priority that
        is not an int."""
        if seq.seq_id in self._added:
            raise ValueError(f"sequence {seq.seq_id} was already added to a scheduler")
        strict_int(seq.max_tokens, "max_tokens", 1)
        strict_int(priority, "priority")
        stops = stop_set(stop_token_ids)
        lesson = self.lesson_scheduler
        if isinstance(lesson, PriorityScheduler):
            lesson.add(seq, priority)
        else:
            lesson.add(seq)
        self._added.add(seq.seq_id)
        if stops:
            self._stops[seq.seq_id] = stops

    def schedule(self) -> ScheduleOutput[reference.Sequence]:
        """The lesson's schedule(), reported; refused as the optimized scheduler refuses it, while the last batch
        awaits its postprocess or abort_step (OPT-27)."""
        refuse_a_second_schedule(self._step_batch)
        lesson = self.lesson_scheduler
        running_before = list(lesson.running)
        waiting_before = {id(s) for s in lesson.waiting if not s.block_table}  # those a prefill would admit

        try:
            batch, is_prefill = lesson.schedule()
        except AssertionError as e:
            if not _is_empty_decode(e, lesson):
                raise
            raise EmptyDecodeError("schedule(): nothing fits and nothing is running (the lesson's assert "
                                   "scheduled_seqs)") from None
        self._step_batch = batch[:]
        # The decode loop preempts from the tail of running (itself last), so this is the order it preempted.
        # Under every policy only a step without prefill preempts (a mixed step that preempted admits none).
        preempted = () if is_prefill else tuple(s for s in reversed(running_before) if s.status is WAITING)
        # Admitted: allocated this step (not the prefill that held its blocks, not a mixed step's decodes).
        admitted = [s for s in batch if id(s) in waiting_before] if is_prefill else []
        hits = sum(s.num_cached_tokens for s in admitted)  # allocate set it to the cached blocks' tokens
        return ScheduleOutput(batch, is_prefill, preempted, hits, sum(s.num_tokens for s in admitted))

    def postprocess(self, seqs: list[reference.Sequence], token_ids: Any,
                    is_prefill: bool) -> list[reference.Sequence]:
        """The lesson's postprocess (with the stop rule when a member has a stop set); who finished, in batch
        order. Refused as the optimized scheduler refuses it, before the lesson sees it: a non-empty batch when no
        step awaits one, a batch that is not the awaiting step's, fewer tokens than sequences or one that is not an
        int64 integer (OPT-23); the lesson gets the tokens as the core reads them, Python ints."""
        if not is_step_batch(seqs, self._step_batch):
            return []
        token_ids = int64_tokens(token_ids, len(seqs)).tolist()  # read as the core reads them
        stops = self._stops
        if stops and any(s.seq_id in stops for s in seqs):
            extensions.postprocess_with_stops(self.lesson_scheduler, seqs, token_ids, is_prefill,
                                              [stops.get(s.seq_id, frozenset()) for s in seqs])
        else:
            self.lesson_scheduler.postprocess(seqs, token_ids, is_prefill)
        self._step_batch = []
        finished = [s for s in seqs if s.status is FINISHED]
        for seq in finished:
            stops.pop(seq.seq_id, None)
        return finished

    def abort(self, seq: reference.Sequence) -> None:
        extensions.abort(self.lesson_scheduler, seq)
        self._stops.pop(seq.seq_id, None)

    def abort_step(self, batch: list[reference.Sequence]) -> None:
        extensions.abort_step(self.lesson_scheduler, batch)
        self._step_batch = []
        for seq in batch:
            self._stops.pop(seq.seq_id, None)

    def snapshot(self) -> SchedulerState:
        """The lesson's state, with the policy's own fields (``policy_state``)."""
        return dataclasses.replace(snapshot(self.lesson_scheduler), **self.policy_state())

    def policy_state(self) -> dict[str, Any]:
        """The ``SchedulerState`` fields of the config's policy, read off its reference: the policy, each live
        sequence's priority (``priority``), each waiting one's passes and the patience (``lpm``)."""
        return policy_fields(self.lesson_scheduler, self.config.policy)
