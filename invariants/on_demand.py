"""The invariants over a live scheduler's blocks, read one block at a time: a check's cost follows the blocks it
reads, never ``num_blocks``.

Invariant: nothing here copies the cache. ``BlocksOnDemand`` stands in for a ``SchedulerState``'s block list and
reads a block when it is indexed (the batch invariants index only the blocks a batch writes); ``check_blocks`` runs
the one-block invariants (INV-2, INV-4) over the blocks it is given. What chooses the blocks (the trace's replay,
TRACE-5; check mode, CHECK-2) lives above; a scheduler is read through its port's ``BlockReader`` (ARCH-4), which
this floor knows only by the methods it calls.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import chain
from typing import Any, Protocol, SupportsIndex, overload

from invariants.state import BlockView, SchedulerState, SeqView
from invariants.state_checks import check_block_content, check_block_refs
from invariants.violation import Violation


class ReadsBlocks(Protocol):
    """What is read of a scheduler port's ``BlockReader``."""

    @property
    def num_blocks(self) -> int: ...
    def is_used(self, block_id: int) -> bool: ...
    def ref_count(self, block_id: int) -> int: ...
    def block_hash(self, block_id: int) -> int: ...
    def token_ids_of(self, block_id: int) -> list[int]: ...


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


def block_view(blocks: ReadsBlocks, block_id: int) -> BlockView:
    """One block as the invariants see it."""
    return BlockView(block_id, blocks.ref_count(block_id), blocks.block_hash(block_id), blocks.token_ids_of(block_id))


class TokenCount(list[int]):
    """A live sequence's tokens as the batch and live-sequence checks read them: their number, no copy of them.

    Reading a token is refused, so no check can silently see none."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self._count = count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: Any) -> Any:
        raise TypeError("a live view holds the number of a sequence's tokens, not the tokens (invariants.seq_view)")

    def __iter__(self) -> Iterator[int]:
        raise TypeError("a live view holds the number of a sequence's tokens, not the tokens (invariants.seq_view)")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenCount) and other._count == self._count

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None

    def __repr__(self) -> str:
        return f"<{self._count} tokens>"


class LiveView(SeqView):
    """A sequence as the batch and live-sequence checks read it: ``seq_view`` with its number of tokens kept and its
    tokens not copied (``TokenCount``)."""

    num_tokens = 0  # an attribute here, kept by ``live_view`` (SeqView computes it from the tokens)


def live_view(seq: Any) -> SeqView:
    """``seq``'s ``LiveView``."""
    count = seq.num_tokens
    view = LiveView(seq.seq_id, seq.status.name, TokenCount(count), seq.num_prompt_tokens, seq.num_cached_tokens,
                    seq.num_scheduled_tokens, list(seq.block_table), seq.max_tokens, seq.is_prefill)
    view.num_tokens = count
    return view


def light_state(port: Any, read: Mapping[int, BlockView] | None = None,
                priorities: Mapping[int, int] | None = None) -> SchedulerState:
    """The state the batch and live-sequence checks read of a scheduler port: the queues (``live_view``), and the
    blocks on demand (no copy of the cache; the free queue, used set and prefix table left empty). ``read``: blocks
    the caller has just read of the same port, served from it instead of read again. The policy and patience are the
    port's config's; ``priorities`` (seq_id -> priority) the caller's, who knows what each request was added with;
    lpm's counts none (the port keeps them to itself: a full snapshot carries them)."""
    config, blocks = port.config, port.blocks
    known = {} if read is None else read
    policy = getattr(config, "policy", "lesson")
    return SchedulerState(
        block_size=config.block_size, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        blocks=BlocksOnDemand(lambda b: known.get(b) or block_view(blocks, b), blocks.num_blocks), free_block_ids=[],
        used_block_ids=set(), hash_to_block_id={}, waiting=[live_view(s) for s in port.waiting],
        running=[live_view(s) for s in port.running], policy=policy,
        patience=getattr(config, "patience", 0) if policy == "lpm" else 0,
        priorities={} if priorities is None else dict(priorities))


def held_counts(port: Any) -> Counter[int]:
    """How many live block tables (running, then waiting) name each block id."""
    return Counter(chain.from_iterable(s.block_table for s in chain(port.running, port.waiting)))


def held_block_violations(port: Any) -> list[Violation]:
    """INV-2 over the blocks live sequences hold: each exists, and ``check_block_refs`` holds for it."""
    found: list[Violation] = []
    blocks = port.blocks
    for block_id, tables in held_counts(port).items():
        if not 0 <= block_id < blocks.num_blocks:
            found.append(Violation("INV-2", f"a live sequence holds nonexistent block {block_id}"))
        else:
            found += check_block_refs(block_id, tables, blocks.is_used(block_id), blocks.ref_count(block_id))
    return found


def check_blocks(views: Iterable[tuple[BlockView, bool]], held: Counter[int], block_size: int) -> list[Violation]:
    """The one-block invariants over some blocks, each given as its view and whether it is used: INV-2 (``held``
    counts the live tables naming each block) and INV-4."""
    found: list[Violation] = []
    for view, used in views:
        found += check_block_refs(view.block_id, held[view.block_id], used, view.ref_count)
        found += check_block_content(view, block_size)
    return found
