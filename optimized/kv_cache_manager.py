"""KV-cache blocks and the prefix cache: the reference BlockManager's decisions on faster machinery.

Invariants (the reference's, spec/invariants.md): every block id is either on
the free queue (``ref_counts[b] == 0``) or used (``ref_counts[b]`` = number of
block tables holding it); ``hash_to_block_id[h] == b`` is trusted only when
block b's stored ``contents`` equal the looked-up block's token bytes; a
released block keeps its hash and contents until it is taken again. What
differs from the reference (OPT-4, OPT-5): per-block state is three flat lists
instead of Block objects; the free queue unlinks a revived block in O(1); a
block's tokens are kept as the exact little-endian bytes that were hashed (so
the comparison is one ``bytes ==``); and chain hashes come from the sequence's
own cache (``Sequence._hashes``), so each full block of a sequence is hashed
once, not once in can_allocate, again in allocate and again in hash_blocks.
"""

from __future__ import annotations

import numpy as np
import xxhash

from optimized.free_queue import FreeBlockQueue
from optimized.sequence import Sequence
from reference.block_manager import Block


def chain_hash(contents: bytes, prefix: int) -> int:
    """xxh64 over the previous block's hash (8 bytes LE, omitted when -1) then the token bytes."""
    if prefix == -1:
        return xxhash.xxh64_intdigest(contents)
    return xxhash.xxh64_intdigest(prefix.to_bytes(8, "little") + contents)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.hashes = [-1] * num_blocks
        self.contents = [b""] * num_blocks
        self.hash_to_block_id: dict[int, int] = {}
        self.free = FreeBlockQueue(num_blocks)

    # --- read-only views in the reference's vocabulary ------------------------------------
    @property
    def free_block_ids(self) -> list[int]:
        return list(self.free)

    @property
    def used_block_ids(self) -> set[int]:
        return {b for b in range(self.num_blocks) if not self.free.contains(b)}

    @property
    def blocks(self) -> list[Block]:
        """Copies as reference Blocks (for inspection; O(num_blocks))."""
        out = []
        for b in range(self.num_blocks):
            block = Block(b)
            block.ref_count = self.ref_counts[b]
            block.hash = self.hashes[b]
            block.token_ids = self.token_ids_of(b)
            out.append(block)
        return out

    def token_ids_of(self, block_id: int) -> list[int]:
        raw = self.contents[block_id]
        return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8)]

    # --- sequence blocks and their hashes ----------------------------------------------------
    def block_contents(self, seq: Sequence, i: int) -> bytes:
        arena = seq._arena
        assert arena is not None, "the sequence was not added to a scheduler"
        start = seq.region_offset + i * self.block_size
        return arena.data[start : start + self.block_size].tobytes()

    def chain_hash_of(self, seq: Sequence, i: int) -> int:
        """The chain hash of full block i of ``seq``, computed at most once per sequence (OPT-5)."""
        hashes = seq._hashes
        while len(hashes) <= i:
            j = len(hashes)
            hashes.append(chain_hash(self.block_contents(seq, j), hashes[j - 1] if j else -1))
        return hashes[i]

    # --- taking and releasing blocks ---------------------------------------------------------
    def take_fresh(self) -> int:
        """The front of the free queue; its old content leaves the prefix cache if the table points at it."""
        return self.take_fresh_many(1)[0]

    def take_fresh_many(self, m: int) -> list[int]:
        """The reference's ``_allocate_block`` m times over: the m front ids, in order (OPT-4)."""
        ids: list[int] = self.free.take(m).tolist()
        hashes, refs = self.hashes, self.ref_counts
        for block_id in ids:
            h = hashes[block_id]
            if h != -1:
                # Distinct blocks carry distinct mapped hashes, so the order of these deletions is immaterial.
                if self.hash_to_block_id.get(h) == block_id:
                    del self.hash_to_block_id[h]
                hashes[block_id] = -1
                self.contents[block_id] = b""
            refs[block_id] = 1
        return ids

    def deallocate(self, seq: Sequence) -> None:
        """Release the table from its end to its start; the freed ids join the queue in that order."""
        refs = self.ref_counts
        freed = []
        for block_id in reversed(seq.block_table):
            refs[block_id] -= 1
            if refs[block_id] == 0:
                freed.append(block_id)
        if freed:
            self.free.extend(np.array(freed, dtype=np.int64))
        seq._ncached = 0
        seq.block_table.clear()

    # --- the reference's BlockManager API, on sequences outside the decode group -------------
    def can_allocate(self, seq: Sequence) -> int:
        """-1 when the free queue cannot cover the sequence, else its cached-block count."""
        num_blocks = (seq._ntok + self.block_size - 1) // self.block_size
        num_new_blocks = num_blocks
        num_cached_blocks = 0
        table, contents, free = self.hash_to_block_id, self.contents, self.free
        for i in range(num_blocks - 1):
            block_id = table.get(self.chain_hash_of(seq, i), -1)
            if block_id == -1 or contents[block_id] != self.block_contents(seq, i):
                break
            num_cached_blocks += 1
            if not free.contains(block_id):
                num_new_blocks -= 1
        if free.count < num_new_blocks:
            return -1
        return num_cached_blocks

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        assert not seq.block_table
        table, refs, free = self.hash_to_block_id, self.ref_counts, self.free
        for i in range(num_cached_blocks):
            block_id = table[seq._hashes[i]]  # can_allocate computed these hashes
            if free.contains(block_id):
                free.remove(block_id)
                refs[block_id] = 1
            else:
                refs[block_id] += 1
            seq.block_table.append(block_id)
        num_blocks = (seq._ntok + self.block_size - 1) // self.block_size
        seq.block_table.extend(self.take_fresh_many(num_blocks - num_cached_blocks))
        seq._ncached = num_cached_blocks * self.block_size

    def can_append(self, seq: Sequence) -> bool:
        return self.free.count >= (seq._ntok % self.block_size == 1)

    def may_append(self, seq: Sequence) -> None:
        if seq._ntok % self.block_size == 1:
            seq.block_table.append(self.take_fresh())

    def hash_blocks(self, seq: Sequence) -> None:
        """Register the blocks this step's tokens filled in the prefix cache."""
        block_size = self.block_size
        start = seq._ncached // block_size
        end = (seq._ncached + seq._nsched) // block_size
        if start == end:
            return
        hashes = seq._hashes
        if len(hashes) < start:
            self.chain_hash_of(seq, start - 1)
        arena = seq._arena
        assert arena is not None
        width = block_size * 8
        base = seq.region_offset
        raw = arena.data[base + start * block_size : base + end * block_size].tobytes()
        block_hashes, contents, table, block_table = self.hashes, self.contents, self.hash_to_block_id, seq.block_table
        for i in range(start, end):
            piece = raw[(i - start) * width : (i - start + 1) * width]
            if len(hashes) > i:
                h = hashes[i]
            else:
                h = chain_hash(piece, hashes[i - 1] if i else -1)
                hashes.append(h)
            block_id = block_table[i]
            block_hashes[block_id] = h
            contents[block_id] = piece
            table[h] = block_id

    def register(self, seq: Sequence, i: int) -> None:
        """Block i of ``seq`` just became full: store its hash and contents, map the hash to it.

        The reference chains from the hash stored on the previous block of the table; that
        block holds this sequence's block i-1 (filled by it, or a cache hit on equal tokens),
        so its hash is this sequence's chain hash i-1 (OPT-5).
        """
        block_id = seq.block_table[i]
        contents = self.block_contents(seq, i)
        hashes = seq._hashes
        if len(hashes) > i:
            h = hashes[i]
        else:
            prefix = self.chain_hash_of(seq, i - 1) if i else -1
            h = chain_hash(contents, prefix)
            hashes.append(h)
        self.hashes[block_id] = h
        self.contents[block_id] = contents
        self.hash_to_block_id[h] = block_id
