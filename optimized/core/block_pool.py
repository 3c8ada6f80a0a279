"""The block pool: which KV-cache blocks are free, and how many tables hold each used one.

Invariants: every block id is either on the free queue (ref count 0) or used;
``_extra[b]`` is a used block's ref count minus one and 0 for every free block,
so taking a fresh block writes no count and releasing a block held once writes
none either; ``_shared`` counts the blocks with ``_extra > 0``. The free queue
is FreeBlockQueue, in the reference deque's order (OPT-6). Every free-queue
entry before absolute position ``clean_end`` is a block that was never used,
so it carries no hash and no pending registration (OPT-14). The pool knows
nothing of hashes: the KV-cache manager forgets a taken block's hash.
"""

from __future__ import annotations

from operator import itemgetter

from optimized.core.free_queue import FreeBlockQueue


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free = FreeBlockQueue(num_blocks)
        self.clean_end = num_blocks
        self._extra = [0] * num_blocks
        self._shared = 0  # blocks with _extra > 0

    # --- views in the reference's vocabulary ---------------------------------------------------------
    @property
    def ref_counts(self) -> list[int]:
        free = self.free
        return [0 if free.contains(b) else e + 1 for b, e in enumerate(self._extra)]

    @property
    def free_block_ids(self) -> list[int]:
        return list(self.free)

    @property
    def used_block_ids(self) -> set[int]:
        return {b for b in range(self.num_blocks) if not self.free.contains(b)}

    def ref_count(self, block_id: int) -> int:
        """How many tables hold the block (0 when it is free); one block read, no scan."""
        return 0 if self.free.contains(block_id) else self._extra[block_id] + 1

    def held(self, block_ids: list[int]) -> list[bool]:
        """Whether each block is used (not on the free queue)."""
        slot, front = self.free.slots(), self.free.front
        return [slot[b] < front for b in block_ids]

    # --- changes -------------------------------------------------------------------------------------
    def hold(self, hits: list[int], all_used: bool) -> None:
        """One more holder for each of ``hits`` (prefix-cache hits); a free one is revived where it stands.

        ``all_used``: every hit is used and none repeats (a shared prefix), so none leaves the queue.
        """
        extra, free = self._extra, self.free
        if all_used:
            for block_id in hits:
                extra[block_id] += 1
            self._shared += sum(1 for b in hits if extra[b] == 1)
            return
        slot, front = free.slots(), free.front
        for block_id in hits:
            if slot[block_id] >= front:  # free: revived where it stands
                free.remove(block_id)
            else:
                if not extra[block_id]:
                    self._shared += 1
                extra[block_id] += 1

    def release(self, table: list[int]) -> list[int]:
        """``deallocate``'s release; the ids freed, which joined the queue in this order (table end first).

        A block with ``_extra`` 0 is held by this table alone and goes back; the others lose one holder.
        """
        extra = self._extra
        freed = table[::-1]
        if self._shared:
            counts = itemgetter(*table)(extra) if len(table) > 1 else tuple(extra[b] for b in table)
            shared = len(counts) - counts.count(0)
            if shared:
                # A block twice in one table (only after a hash collision) has extra >= 1 and is in held.
                prefix = shared == len(counts) or counts.index(0) == shared
                held = table[:shared] if prefix else [b for b in table if extra[b]]
                if len(set(held)) == len(held):
                    # The usual shape: a shared prefix, then the table's own blocks.
                    freed = freed[: len(counts) - shared] if prefix else [b for b in freed if not extra[b]]
                    for block_id in held:
                        extra[block_id] -= 1
                    self._shared -= counts.count(1)  # those that had one other holder are now its alone
                else:  # the reference's loop, one holder at a time
                    freed = []
                    for block_id in reversed(table):
                        if extra[block_id]:
                            extra[block_id] -= 1
                            if not extra[block_id]:
                                self._shared -= 1
                        else:
                            freed.append(block_id)
        if freed:
            self.free.extend(freed)
        return freed
