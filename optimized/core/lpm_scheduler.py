"""The ``lpm`` policy (spec/policies.md, POLICY-8..10), decision for decision reference/lpm_scheduler.py's.

Invariant (POLICY-8): before each prefill loop ``waiting`` is the partly prefilled front (if any), then the due
requests (passed over at least ``patience`` times) by arrival, then the rest by how many leading blocks the
prefix cache holds now, most first, ties by arrival; the lesson's loops (the base class's, unchanged) then
decide. Between steps ``passes[seq_id]`` is how often each live request was passed over (POLICY-10): a
prefill step gave a later arrival its first chunk while it kept waiting. What differs from the reference:
the cached-block count is the prefix-cache walk on the sequence's own chain hashes (each block hashed once,
OPT-7; the reference rehashes every block of every waiting request each step), only the requests that are
not due are counted, and none when one or none of them waits.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from invariants.block_math import blocks_for
from optimized.core.config import SchedulerConfig
from optimized.core.kv_cache_manager import KVCacheManager
from optimized.core.port import ScheduleOutput
from optimized.core.scheduler import Scheduler
from optimized.core.sequence import Sequence


class LpmCacheManager(KVCacheManager):
    """The KV-cache manager, able to count a waiting sequence's cached leading blocks without remembering the walk."""

    def cached_prefix_blocks(self, seq: Sequence) -> int:
        """The hits of ``can_allocate``'s walk now (the last block never), whether or not the rest would fit.

        The walk of ``_fresh_walk``, less what only ``allocate`` reads (which hits are held); the walk
        remembered for ``can_allocate`` (OPT-15) is left as it is.
        """
        self.flush()
        last = blocks_for(seq.core.ntok, self.block_size) - 1
        if last <= 0:
            return 0
        self.extend_chain(seq, 1)
        chain, table = seq.core.hashes, self._table
        if chain[0] not in table:
            return 0
        self.extend_chain(seq, last)
        found = list(map(table.get, chain[:last]))
        m = found.index(None) if None in found else last
        hits: list[int] = found[:m]  # type: ignore[assignment]  # no None before m
        stored, pieces = list(map(self._contents.get, hits)), seq.core.pieces
        if stored == pieces[:m]:
            return m
        return next(j for j in range(m) if stored[j] != pieces[j])  # equal hashes, other tokens: the walk ends


class LpmScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.block_manager: LpmCacheManager = LpmCacheManager(config.num_blocks, config.block_size)
        self.patience = config.patience
        self._passes: dict[int, int] = {}  # seq_id -> times passed over, for every live sequence

    def add(self, seq: Sequence, stop_token_ids: Collection[int] = (), priority: int = 0) -> None:
        super().add(seq, stop_token_ids, priority)
        self._passes[seq.seq_id] = 0

    def _prefill(self) -> ScheduleOutput[Sequence] | None:
        self._order_waiting()
        waiting = self._waiting
        unallocated = {s.seq_id for s in waiting if not s.block_table}  # those this step may admit
        out = super()._prefill()
        if out is None:
            return None
        batch = out.batch
        fresh = [s.seq_id for s in batch if s.seq_id in unallocated]
        if fresh:
            latest, passes = max(fresh), self._passes
            scheduled = {s.seq_id for s in batch}
            for seq in waiting:  # after the loop: the requests that kept waiting (and a chunk, in the batch)
                seq_id = seq.seq_id
                if seq_id < latest and seq_id not in scheduled:
                    passes[seq_id] += 1
        return out

    def _order_waiting(self) -> None:
        """Partly prefilled front first, then the due by arrival, then the rest by cached blocks, most first."""
        waiting = self._waiting
        rest = list(waiting)
        front = [rest.pop(0)] if rest and rest[0].block_table else []
        patience, passes = self.patience, self._passes
        due = sorted((s for s in rest if passes[s.seq_id] >= patience), key=_arrival)
        others = [s for s in rest if passes[s.seq_id] < patience] if due else rest
        if len(others) > 1:
            count = self.block_manager.cached_prefix_blocks
            others.sort(key=lambda s: (-count(s), s.seq_id))
        waiting.clear()
        waiting.extend(front + due + others)

    def _finish(self, seq: Sequence) -> None:
        super()._finish(seq)
        del self._passes[seq.seq_id]

    def policy_state(self) -> dict[str, Any]:
        """``passes`` (seq_id -> times passed over) of the waiting requests, and the bound."""
        passes = self._passes
        return {"policy": "lpm", "patience": self.patience,
                "passes": {s.seq_id: passes[s.seq_id] for s in self._waiting}}


def _arrival(seq: Sequence) -> int:
    return seq.seq_id
