"""What ``can_allocate`` read for one waiting sequence, kept while it stays valid (OPT-15).

Invariant: while a memo is kept, walking the prefix cache again for its
sequence would give the same hits; the KV-cache manager drops it (or cuts it,
or marks hits freed) whenever it changes a hash, a table entry or a block the
walk read.
"""

from __future__ import annotations

from optimized.core.sequence import Sequence


class WalkMemo:
    """What ``can_allocate`` read for one sequence, kept up to date while it stays valid (OPT-15).

    The walk looked up the chain hashes ``hashes`` (hash -> first index; the
    hits and the one that missed); the first ``cached`` of ``hits`` are the
    blocks it hit (``blocks``: block -> index), ``held[i]`` says whether hit i
    is used. The blocks' contents need no watching of their own: a block's
    contents change only when it is taken fresh, which first removes the table
    entry naming it, a looked-up hash (a hit's, or at an xxh64 collision the
    one the walk ended at). Taking hit i cuts the walk to i hits; releasing a
    used hit makes it free; mapping a looked-up hash drops the memo.
    """

    __slots__ = ("_blocks", "_hashes", "cached", "held", "hits", "looked", "seq", "used")

    def __init__(self, seq: Sequence, hits: list[int], held: list[bool], looked: list[int]) -> None:
        self.seq = seq
        self.hits = hits
        self.held = held
        self.cached = len(hits)
        self.used = sum(held)
        self.looked = looked
        # Built on first use: most walks are followed at once by allocate, which drops the memo.
        self._hashes: dict[int, int] | None = None
        self._blocks: dict[int, int] | None = None

    @property
    def hashes(self) -> dict[int, int]:
        if self._hashes is None:
            looked = self.looked
            # Built backwards so that a repeated hash keeps its first index.
            self._hashes = dict(zip(reversed(looked), range(len(looked) - 1, -1, -1), strict=True))
        return self._hashes

    @property
    def blocks(self) -> dict[int, int]:
        if self._blocks is None:
            hits = self.hits
            self._blocks = dict(zip(reversed(hits), range(len(hits) - 1, -1, -1), strict=True))
        return self._blocks

    def reads(self, h: int) -> bool:
        """Whether mapping ``h`` could change the walk's answer.

        Entries past the walk's end (left by ``cut``) are ignored: the walk no longer reaches them.
        """
        return self.hashes.get(h, self.cached + 1) <= self.cached

    def cut(self, index: int) -> None:
        """Hit ``index`` lost its table entry: the walk now stops there."""
        if index < self.cached:
            self.cached = index
            del self.held[index:]
            self.used = sum(self.held)

    def freed(self, block_ids: list[int]) -> None:
        """These blocks went back to the free queue: every hit among them is no longer used.

        A hash collision can make two hits one block: each of them is freed.
        """
        if self.blocks.keys().isdisjoint(block_ids):
            return
        gone = set(block_ids)
        held, hits = self.held, self.hits
        for index in range(self.cached):
            if held[index] and hits[index] in gone:
                held[index] = False
                self.used -= 1
