"""KV-cache blocks and the prefix cache, as spec/block-manager.md states them.

Invariants: every block id is in exactly one of ``free_block_ids`` (a FIFO
queue) and ``used_block_ids``; a used block's ``ref_count`` is the number of
block tables holding it and a free block's is 0; a mapping
``hash_to_block_id[h] == b`` is only trusted when block ``b`` still carries
hash ``h`` and the same tokens (callers compare ``token_ids``). Released blocks
keep their hash so a later request can hit them until they are taken again.
The data structures are the simple ones (``deque.remove`` is O(n)); the
optimized package keeps the decisions and changes the machinery.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import xxhash

from reference.sequence import Sequence


def compute_hash(token_ids: list[int], prefix: int = -1) -> int:
    """xxh64 over the previous full block's hash (8 bytes LE) then the tokens (int64 LE)."""
    h = xxhash.xxh64()
    if prefix != -1:
        h.update(prefix.to_bytes(8, "little"))
    h.update(np.array(token_ids, dtype="<i8").tobytes())
    return h.intdigest()


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []

    def update(self, h: int, token_ids: list[int]) -> None:
        self.hash = h
        self.token_ids = token_ids

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    def _allocate_block(self) -> Block:
        """Take the fresh block at the front of the free queue."""
        block_id = self.free_block_ids[0]
        block = self.blocks[block_id]
        assert block.ref_count == 0
        # Its old content is about to be overwritten: forget it in the prefix cache,
        # unless the table already points at a newer copy elsewhere.
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.reset()
        self.free_block_ids.popleft()
        self.used_block_ids.add(block_id)
        return block

    def _deallocate_block(self, block_id: int) -> None:
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def can_allocate(self, seq: Sequence) -> int:
        """-1 when the free queue cannot cover the sequence, else its cached-block count."""
        h = -1
        num_cached_blocks = 0
        num_new_blocks = seq.num_blocks
        # The last block is never taken from the cache, even when full: at least
        # one token must be computed to produce the next token's logits.
        for i in range(seq.num_blocks - 1):
            token_ids = seq.block(i)
            h = compute_hash(token_ids, h)
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                break
            num_cached_blocks += 1
            if block_id in self.used_block_ids:
                num_new_blocks -= 1
        if len(self.free_block_ids) < num_new_blocks:
            return -1
        return num_cached_blocks

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        assert not seq.block_table
        h = -1
        for i in range(num_cached_blocks):
            token_ids = seq.block(i)
            h = compute_hash(token_ids, h)
            block_id = self.hash_to_block_id[h]
            block = self.blocks[block_id]
            if block_id in self.used_block_ids:
                block.ref_count += 1
            else:
                block.ref_count = 1
                self.free_block_ids.remove(block_id)
                self.used_block_ids.add(block_id)
            seq.block_table.append(block_id)
        for _ in range(num_cached_blocks, seq.num_blocks):
            seq.block_table.append(self._allocate_block().block_id)
        seq.num_cached_tokens = num_cached_blocks * self.block_size

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq: Sequence) -> bool:
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq: Sequence) -> None:
        if len(seq) % self.block_size == 1:
            seq.block_table.append(self._allocate_block().block_id)

    def hash_blocks(self, seq: Sequence) -> None:
        """Register the blocks this step's tokens filled in the prefix cache."""
        start = seq.num_cached_tokens // self.block_size
        end = (seq.num_cached_tokens + seq.num_scheduled_tokens) // self.block_size
        if start == end:
            return
        h = self.blocks[seq.block_table[start - 1]].hash if start > 0 else -1
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            token_ids = seq.block(i)
            h = compute_hash(token_ids, h)
            block.update(h, token_ids)
            self.hash_to_block_id[h] = block.block_id
