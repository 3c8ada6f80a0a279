"""The invariants a replay checks at each step, at a cost independent of the cache's size (TRACE-5).

Invariant: after every ``schedule()`` the replay checks every batch invariant
(INV-8..14, 16, 18, ``check_batch`` whole) and, after every change of state,
INV-2 over the blocks live sequences hold (each exists, and
``invariants.check_block_refs`` holds for it); every ``FULL_EVERY``-th step and
at the end of the trace it checks every state invariant over a full snapshot.
Blocks are read one at a time through the scheduler port's ``BlockReader``
(ARCH-4), so what one step costs grows with the blocks the live sequences hold,
never with ``num_blocks``: a GPU run's cache has millions of blocks, almost all
of them untouched by any one step. The rules are the invariants'; this module
only chooses which blocks they read.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, SupportsIndex, overload

from invariants import check_batch, check_block_refs, check_state, seq_view, snapshot
from invariants.state import BlockView, SchedulerState
from invariants.violation import Violation
from optimized.core.port import BlockReader, SchedulerPort

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


def block_view(blocks: BlockReader, block_id: int) -> BlockView:
    """One block as the invariants see it."""
    return BlockView(block_id, blocks.ref_count(block_id), blocks.block_hash(block_id), blocks.token_ids_of(block_id))


def light_state(port: SchedulerPort[Any]) -> SchedulerState:
    """The state the batch checks read: the queues, and the blocks on demand (no copy of the cache)."""
    config, blocks = port.config, port.blocks
    return SchedulerState(
        block_size=config.block_size, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        blocks=BlocksOnDemand(lambda b: block_view(blocks, b), blocks.num_blocks), free_block_ids=[],
        used_block_ids=set(), hash_to_block_id={}, waiting=[seq_view(s) for s in port.waiting],
        running=[seq_view(s) for s in port.running])


def held_block_violations(port: SchedulerPort[Any]) -> list[Violation]:
    """INV-2 over the blocks live sequences hold: each exists, and ``check_block_refs`` holds for it."""
    found: list[Violation] = []
    blocks = port.blocks
    held = Counter(b for s in (*port.running, *port.waiting) for b in s.block_table)
    for block_id, tables in held.items():
        if not 0 <= block_id < blocks.num_blocks:
            found.append(Violation("INV-2", f"a live sequence holds nonexistent block {block_id}"))
        else:
            found += check_block_refs(block_id, tables, blocks.is_used(block_id), blocks.ref_count(block_id))
    return found


def batch_violations(port: SchedulerPort[Any], batch: list[Any], prefill: bool, full: bool) -> list[Violation]:
    """Right after ``schedule()``: every batch invariant and INV-2 on the held blocks; with ``full``, every state
    invariant from a snapshot as well."""
    views = [seq_view(s) for s in batch]
    if full:
        state = snapshot(port)
        return check_state(state, between_steps=False) + check_batch(state, views, prefill)
    return held_block_violations(port) + check_batch(light_state(port), views, prefill)


def state_violations(port: SchedulerPort[Any], full: bool) -> list[Violation]:
    """Between steps: INV-2 on the held blocks; with ``full``, every state invariant from a snapshot."""
    if full:
        return check_state(snapshot(port), between_steps=True)
    return held_block_violations(port)
