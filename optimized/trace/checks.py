"""The invariants a replay checks at each step, at a cost independent of the cache's size (TRACE-5).

Invariant: after every ``schedule()`` the replay checks every batch invariant
(INV-8..14, 16, 18, ``check_batch`` whole) and, after every change of state,
that each block a live sequence holds exists, is used and has as many
references as tables hold it (INV-2 over the held blocks); every
``FULL_EVERY``-th step and at the end of the trace it checks every state
invariant over a full snapshot. What one step costs so grows with the blocks
the live sequences hold, never with ``num_blocks``: a GPU run's cache has
millions of blocks, almost all of them untouched by any one step.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, SupportsIndex, overload

import reference
from invariants import check_batch, check_state, seq_view, snapshot
from invariants.state import BlockView, SchedulerState
from invariants.violation import Violation

FULL_EVERY = 64  # every 64th step (and the end of the trace) checks the whole state from a snapshot


class BlocksOnDemand(list[BlockView]):
    """A scheduler's blocks, each read when indexed: the batch checks index only the blocks a batch writes.

    Iterating it (what a check over every block does) is refused, so no check can silently see no blocks.
    """

    def __init__(self, read: Callable[[int], BlockView], count: int) -> None:
        super().__init__()
        self._read, self._count = read, count

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: SupportsIndex) -> BlockView: ...

    @overload
    def __getitem__(self, index: slice) -> list[BlockView]: ...

    def __getitem__(self, index: SupportsIndex | slice) -> BlockView | list[BlockView]:
        if isinstance(index, slice):
            raise TypeError("blocks read on demand are indexed one at a time")
        block_id = operator.index(index)
        if not 0 <= block_id < self._count:
            raise IndexError(f"block {block_id} of {self._count}")
        return self._read(block_id)

    def __iter__(self) -> Iterator[BlockView]:
        raise TypeError("a check over every block needs a full snapshot (invariants.snapshot)")


class BlockReader:
    """One block of either scheduler at a time: its view and whether it is used."""

    def __init__(self, scheduler: Any) -> None:
        self.bm = scheduler.block_manager
        self.is_reference = isinstance(scheduler, reference.Scheduler)
        self.num_blocks: int = len(self.bm.blocks) if self.is_reference else self.bm.pool.num_blocks

    def used(self, block_id: int) -> bool:
        if self.is_reference:
            return block_id in self.bm.used_block_ids
        return not self.bm.free.contains(block_id)

    def view(self, block_id: int) -> BlockView:
        bm = self.bm
        if self.is_reference:
            block = bm.blocks[block_id]
            return BlockView(block_id, block.ref_count, block.hash, list(block.token_ids))
        # The optimized pool keeps a used block's references past the first (OPT-4's layout).
        refs = bm.pool._extra[block_id] + 1 if self.used(block_id) else 0
        return BlockView(block_id, refs, bm.block_hash(block_id), bm.token_ids_of(block_id))


def light_state(scheduler: Any, reader: BlockReader) -> SchedulerState:
    """The state the batch checks read: the queues, and the blocks on demand (no copy of the cache)."""
    return SchedulerState(
        block_size=scheduler.block_size, max_num_seqs=scheduler.max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        blocks=BlocksOnDemand(reader.view, reader.num_blocks), free_block_ids=[], used_block_ids=set(),
        hash_to_block_id={}, waiting=[seq_view(s) for s in scheduler.waiting],
        running=[seq_view(s) for s in scheduler.running])


def held_block_violations(scheduler: Any, reader: BlockReader) -> list[Violation]:
    """INV-2 over the blocks live sequences hold: each exists, is used, and has one reference per table."""
    found: list[Violation] = []
    held = Counter(b for s in (*scheduler.running, *scheduler.waiting) for b in s.block_table)
    for block_id, tables in held.items():
        if not 0 <= block_id < reader.num_blocks:
            found.append(Violation("INV-2", f"a live sequence holds nonexistent block {block_id}"))
        elif not reader.used(block_id):
            found.append(Violation("INV-2", f"block {block_id} is held by {tables} tables but not used"))
        elif (refs := reader.view(block_id).ref_count) != tables:
            found.append(Violation("INV-2", f"block {block_id} has ref_count {refs} but {tables} block tables "
                                            "hold it"))
    return found


def batch_violations(scheduler: Any, reader: BlockReader, batch: list[Any], prefill: bool,
                     full: bool) -> list[Violation]:
    """Right after ``schedule()``: every batch invariant and INV-2 on the held blocks; with ``full``, every state
    invariant from a snapshot as well."""
    views = [seq_view(s) for s in batch]
    if full:
        state = snapshot(scheduler)
        return check_state(state, between_steps=False) + check_batch(state, views, prefill)
    return held_block_violations(scheduler, reader) + check_batch(light_state(scheduler, reader), views, prefill)


def state_violations(scheduler: Any, reader: BlockReader, full: bool) -> list[Violation]:
    """Between steps: INV-2 on the held blocks; with ``full``, every state invariant from a snapshot."""
    if full:
        return check_state(snapshot(scheduler), between_steps=True)
    return held_block_violations(scheduler, reader)
