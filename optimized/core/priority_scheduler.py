"""The ``priority`` policy (spec/policies.md, POLICY-5..7), decision for decision reference/priority_scheduler.py's.

Invariant (POLICY-6): between steps ``running`` is sorted by (priority, seq_id), and so is ``waiting`` past a
partly prefilled front (it holds blocks and is finished first). The keys are unique, so keeping that order
is all the reference does beyond the lesson: a sequence is put in its place by bisection, never by sorting.
The lesson's loops then decide as they do (the base class's, unchanged): admit from the front of ``waiting``,
decode from the front of ``running``, preempt its tail. The decode group stays a prefix of ``running``
(decode_group.py): a prefill that lands a sequence among the members makes the members from its place on
leave the group (they join again, in order, at the next decode); one that lands behind them keeps it whole.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection
from typing import Any

from optimized.core.config import SchedulerConfig
from optimized.core.errors import strict_int
from optimized.core.port import ScheduleOutput
from optimized.core.scheduler import RUNNING, Scheduler
from optimized.core.sequence import Sequence


class PriorityScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._keys: dict[int, tuple[int, int]] = {}  # seq_id -> (priority, seq_id), for every live sequence

    def _key(self, seq: Sequence) -> tuple[int, int]:
        return self._keys[seq.seq_id]

    def add(self, seq: Sequence, stop_token_ids: Collection[int] = (), priority: int = 0) -> None:
        """Queue ``seq`` at its (priority, arrival) place; ValueError (and no change) as the base class's add."""
        strict_int(priority, "priority")
        self._check_new(seq)
        self._queue(seq, stop_token_ids)  # appends it (or raises, nothing changed)
        self._keys[seq.seq_id] = (priority, seq.seq_id)
        self._waiting.pop()
        self._insert_waiting(seq)

    def _insert_waiting(self, seq: Sequence) -> None:
        """Never before a waiting[0] that holds blocks (a prefill cut short)."""
        waiting = self._waiting
        first = 1 if waiting and waiting[0].block_table else 0
        waiting.insert(bisect.bisect(waiting, self._keys[seq.seq_id], lo=first, key=self._key), seq)

    def _prefill(self) -> ScheduleOutput[Sequence] | None:
        out = super()._prefill()
        if out is not None:
            self._place_admitted(sum(1 for s in out.batch if s.core.status is RUNNING))
        return out

    def _place_admitted(self, count: int) -> None:
        """The last ``count`` of ``running`` finished their prefill this step: each to its place."""
        if not count:
            return
        running, group, key = self._running, self._group, self._key
        admitted = running[-count:]
        del running[-count:]
        # Where the most urgent of them lands: members from there on are no longer a prefix of running.
        place = bisect.bisect(running, min(map(key, admitted)), key=key)
        members = group.members
        if place < len(members):
            for seq in members[place:]:
                group.settle(seq)
            group.truncate(place)
        for seq in admitted:
            bisect.insort(running, seq, key=key)

    def _preempt(self, seq: Sequence) -> None:
        super()._preempt(seq)  # the lesson's preempt puts it at the front of waiting: to its place instead
        self._waiting.popleft()
        self._insert_waiting(seq)

    def _finish(self, seq: Sequence) -> None:
        super()._finish(seq)
        del self._keys[seq.seq_id]

    def policy_state(self) -> dict[str, Any]:
        """Each live sequence's priority (``priorities``: seq_id -> priority)."""
        return {"policy": "priority", "priorities": {seq_id: p for seq_id, (p, _) in self._keys.items()}}

