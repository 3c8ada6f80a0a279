"""BEYOND THE LESSON: the ``priority`` policy (spec/policies.md, POLICY-5..7).

Each request has a priority, an int, lower first (vLLM's convention); ties go
by arrival. The lesson's scheduler (reference/scheduler.py, unchanged) is kept
whole: both queues are simply kept in (priority, arrival) order instead of
arrival order, so its prefill loop admits the most urgent waiting sequence
first, its decode loop decodes the most urgent running ones first, and its
``running.pop()`` preempts the least urgent, newest sequence. A partly
prefilled sequence stays at the front of ``waiting`` (it holds blocks; the
lesson finishes it first). Invariant: between steps ``running``, and
``waiting`` past such a front, are sorted by (priority, seq_id); with every
priority equal, every decision is the lesson's.
"""

from __future__ import annotations

import bisect
from collections import deque

from reference.config import SchedulerConfig
from reference.scheduler import Scheduler
from reference.sequence import Sequence, SequenceStatus


class PriorityScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.priority: dict[int, int] = {}  # seq_id -> its request's priority

    def add(self, seq: Sequence, priority: int = 0) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        self.priority[seq.seq_id] = priority
        self._insert(self.waiting, seq)

    def key(self, seq: Sequence) -> tuple[int, int]:
        return self.priority[seq.seq_id], seq.seq_id

    def schedule(self) -> tuple[list[Sequence], bool]:
        batch, is_prefill = super().schedule()
        if is_prefill:  # the lesson appends each finished prefill to running: move each to its place
            admitted = [seq for seq in batch if seq.status is SequenceStatus.RUNNING]
            for seq in admitted:  # all out first: a bisection needs the queue it searches sorted
                self.running.remove(seq)
            for seq in admitted:
                self._insert(self.running, seq)
        return batch, is_prefill

    def preempt(self, seq: Sequence) -> None:
        super().preempt(seq)  # the lesson puts it at the front of waiting: move it to its place
        self.waiting.popleft()
        self._insert(self.waiting, seq)

    def _insert(self, queue: deque[Sequence], seq: Sequence) -> None:
        """Put ``seq`` in its (priority, arrival) place; never before a partly prefilled ``waiting[0]``, which holds
        blocks and is finished first, as in the lesson."""
        first = 1 if queue is self.waiting and queue and queue[0].block_table else 0
        keys = [self.key(s) for s in queue]
        queue.insert(max(first, bisect.bisect(keys, self.key(seq), lo=first)), seq)
