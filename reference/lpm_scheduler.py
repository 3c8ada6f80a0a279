"""BEYOND THE LESSON: the ``lpm`` policy, longest prefix match first (spec/policies.md, POLICY-8..10).

Before each step the waiting sequences are put in order of how many of their
leading blocks the prefix cache holds right now (most first, ties by
arrival), as SGLang orders its queue to raise cache hits; then the lesson's
scheduler (reference/scheduler.py, unchanged) decides the step. Reordering
alone would let a request with no cached prefix wait forever behind a stream
of requests that share one, so each waiting request counts how often it was
passed over: a prefill step gave a later arrival its first chunk while it kept
waiting. A request passed over ``patience`` times is due: due requests go
first, in arrival order. Invariant (the starvation bound, POLICY-10): no
request is passed over more than ``patience`` times. A partly prefilled
sequence stays at the front of ``waiting``, as in the lesson.
"""

from __future__ import annotations

from collections import deque

from reference.block_manager import BlockManager, compute_hash
from reference.config import SchedulerConfig
from reference.scheduler import Scheduler
from reference.sequence import Sequence

DEFAULT_PATIENCE = 8


def cached_prefix_blocks(block_manager: BlockManager, seq: Sequence) -> int:
    """How many leading blocks of ``seq`` the prefix cache holds now, counted as ``can_allocate`` counts them (the
    last block never), whether or not the free queue could take the rest."""
    h = -1
    count = 0
    for i in range(seq.num_blocks - 1):
        token_ids = seq.block(i)
        h = compute_hash(token_ids, h)
        block_id = block_manager.hash_to_block_id.get(h, -1)
        if block_id == -1 or block_manager.blocks[block_id].token_ids != token_ids:
            break
        count += 1
    return count


class LpmScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig, patience: int = DEFAULT_PATIENCE) -> None:
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"patience must be an int >= 0, got {patience!r}")
        super().__init__(config)
        self.patience = patience
        self.passes: dict[int, int] = {}  # seq_id -> times a later arrival was admitted while it waited

    def add(self, seq: Sequence) -> None:
        self.passes[seq.seq_id] = 0
        super().add(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        self._order_waiting()
        admitted = [s.seq_id for s in self.waiting if not s.block_table]  # those not yet holding blocks
        batch, is_prefill = super().schedule()
        if is_prefill:
            fresh = [s.seq_id for s in batch if s.seq_id in admitted]
            for seq in self.waiting:
                if seq not in batch and fresh and seq.seq_id < max(fresh):
                    self.passes[seq.seq_id] += 1
        return batch, is_prefill

    def _order_waiting(self) -> None:
        """Partly prefilled front first, then the due in arrival order, then the rest by cached blocks, most first."""
        waiting = list(self.waiting)
        front = waiting[:1] if waiting and waiting[0].block_table else []
        rest = waiting[len(front):]
        due = sorted((s for s in rest if self.passes[s.seq_id] >= self.patience), key=lambda s: s.seq_id)
        others = [s for s in rest if self.passes[s.seq_id] < self.patience]
        others.sort(key=lambda s: (-cached_prefix_blocks(self.block_manager, s), s.seq_id))
        self.waiting = deque(front + due + others)
