"""KV-cache blocks and the prefix cache: the reference BlockManager's decisions on faster machinery.

Invariants (the reference's, spec/invariants.md), true whenever the prefix
cache is read: every block id is either on the free queue (ref count 0) or used
(ref count = number of block tables holding it); ``table[h] == b`` implies block
b carries hash h; a lookup hit also needs equal token bytes; a released block
keeps its hash and contents until it is taken again. What differs from the
reference (spec/optimized-scheduler.md):

* per-block state is flat lists, the free queue is FreeBlockQueue (OPT-4);
* chain hashes come from the sequence's own cache, so each full block of a
  sequence is hashed at most once (OPT-5);
* registering full blocks (``hash_blocks``) only appends (sequence, first
  index, block ids) to ``pending``; the log is applied in order (``flush``) before anything
  reads the table or a block's hash: a lookup (``can_allocate``), taking a block
  that has a pending registration, any inspection. The table then holds exactly
  what the reference's eager registrations would have left (OPT-8).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import xxhash
from xxhash import xxh64_intdigest

from optimized.free_queue import FreeBlockQueue
from optimized.sequence import Sequence
from reference.block_manager import Block

I64 = npt.NDArray[np.int64]


def chain_hash(contents: bytes, prefix: int) -> int:
    """xxh64 over the previous block's hash (8 bytes LE, omitted when -1) then the token bytes."""
    if prefix == -1:
        return xxhash.xxh64_intdigest(contents)
    return xxhash.xxh64_intdigest(prefix.to_bytes(8, "little") + contents)


def tokens_of(seq: Sequence) -> tuple[I64, int]:
    """The array holding the sequence's tokens and where they start in it."""
    if seq._arena is not None:
        return seq._arena.data, seq.region_offset
    assert seq._own is not None
    return seq._own, 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._hashes = [-1] * num_blocks
        self._contents = [b""] * num_blocks
        self._table: dict[int, int] = {}
        self.free = FreeBlockQueue(num_blocks)
        self.pending: list[tuple[Sequence, int, list[int]]] = []
        self._is_pending = [False] * num_blocks

    # --- read-only views in the reference's vocabulary (each flushes first) --------------------------
    @property
    def hash_to_block_id(self) -> dict[int, int]:
        self.flush()
        return dict(self._table)

    @property
    def free_block_ids(self) -> list[int]:
        return list(self.free)

    @property
    def used_block_ids(self) -> set[int]:
        return {b for b in range(self.num_blocks) if not self.free.contains(b)}

    def block_hash(self, block_id: int) -> int:
        self.flush()
        return self._hashes[block_id]

    def token_ids_of(self, block_id: int) -> list[int]:
        self.flush()
        raw = self._contents[block_id]
        return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8)]

    @property
    def blocks(self) -> list[Block]:
        """Copies as reference Blocks (for inspection; O(num_blocks))."""
        out = []
        for b in range(self.num_blocks):
            block = Block(b)
            block.ref_count = self.ref_counts[b]
            block.hash = self.block_hash(b)
            block.token_ids = self.token_ids_of(b)
            out.append(block)
        return out

    # --- hashes ---------------------------------------------------------------------------------------
    def block_contents(self, seq: Sequence, i: int) -> bytes:
        data, base = tokens_of(seq)
        start = base + i * self.block_size
        return data[start : start + self.block_size].tobytes()

    def chain_hash_of(self, seq: Sequence, i: int) -> int:
        """The chain hash of full block i of ``seq``, computed at most once per sequence (OPT-5)."""
        hashes = seq._hashes
        while len(hashes) <= i:
            j = len(hashes)
            hashes.append(chain_hash(self.block_contents(seq, j), hashes[j - 1] if j else -1))
        return hashes[i]

    def defer(self, seq: Sequence, start: int, block_ids: list[int]) -> None:
        """Blocks start, start+1, ... of ``seq`` (held in ``block_ids``) just became full: register them later."""
        self.pending.append((seq, start, block_ids))
        is_pending = self._is_pending
        for block_id in block_ids:
            is_pending[block_id] = True

    def flush(self) -> None:
        """Apply the pending registrations in order: store hash and contents, map the hash to the block.

        The reference chains from the hash stored on the previous block of the table; that block
        holds this sequence's block i-1 (filled by it, or a cache hit on equal tokens), so its hash
        is this sequence's chain hash i-1, which is what ``chain_hash_of`` returns (OPT-5).
        """
        if not self.pending:
            return
        hashes, contents, table, is_pending = self._hashes, self._contents, self._table, self._is_pending
        block_size = self.block_size
        width = 8 * block_size
        for seq, start, block_ids in self.pending:
            chain = seq._hashes
            prev = -1 if start == 0 else self.chain_hash_of(seq, start - 1)
            data, base = tokens_of(seq)
            raw = data[base + start * block_size : base + (start + len(block_ids)) * block_size].tobytes()
            for k, block_id in enumerate(block_ids):
                piece = raw[k * width : (k + 1) * width]
                i = start + k
                if len(chain) > i:
                    h = chain[i]
                else:
                    h = xxh64_intdigest(prev.to_bytes(8, "little") + piece) if i else xxh64_intdigest(piece)
                    chain.append(h)
                prev = h
                hashes[block_id] = h
                contents[block_id] = piece
                table[h] = block_id
                is_pending[block_id] = False
        self.pending.clear()

    # --- taking and releasing blocks ------------------------------------------------------------------
    def take_fresh(self) -> int:
        return self.take_fresh_many(1)[0]

    def take_fresh_many(self, m: int) -> list[int]:
        """The reference's ``_allocate_block`` m times over: the m front ids, in order (OPT-4)."""
        ids = self.free.take(m)
        hashes, refs, is_pending = self._hashes, self.ref_counts, self._is_pending
        if self.pending:
            for block_id in ids:
                if is_pending[block_id]:
                    self.flush()  # its old hash must leave the table as the reference's would
                    break
        for block_id in ids:
            refs[block_id] = 1
            h = hashes[block_id]
            if h != -1:
                # Distinct blocks carry distinct mapped hashes: the order of these deletions is immaterial.
                if self._table.get(h) == block_id:
                    del self._table[h]
                hashes[block_id] = -1
                self._contents[block_id] = b""
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
            self.free.extend(freed)
        seq._ncached = 0
        seq.block_table.clear()

    # --- the reference's BlockManager API, on sequences outside the decode group ----------------------
    def can_allocate(self, seq: Sequence) -> int:
        """-1 when the free queue cannot cover the sequence, else its cached-block count."""
        self.flush()
        block_size = self.block_size
        num_blocks = (seq._ntok + block_size - 1) // block_size
        num_new_blocks = num_blocks
        num_cached_blocks = 0
        table, contents, free = self._table, self._contents, self.free
        chain = seq._hashes
        data, base = tokens_of(seq)
        # The bytes of every block the walk may visit, read once; hashing and comparing slice them.
        raw = data[base : base + (num_blocks - 1) * block_size].tobytes()
        width = 8 * block_size
        for i in range(num_blocks - 1):
            piece = raw[i * width : (i + 1) * width]
            if len(chain) > i:
                h = chain[i]
            else:
                h = xxh64_intdigest(chain[i - 1].to_bytes(8, "little") + piece) if i else xxh64_intdigest(piece)
                chain.append(h)
            block_id = table.get(h, -1)
            if block_id == -1 or contents[block_id] != piece:
                break
            num_cached_blocks += 1
            if not free.contains(block_id):
                num_new_blocks -= 1
        if free.count < num_new_blocks:
            return -1
        return num_cached_blocks

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        assert not seq.block_table
        table, refs, free = self._table, self.ref_counts, self.free
        for i in range(num_cached_blocks):
            block_id = table[seq._hashes[i]]  # can_allocate flushed and computed these hashes
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
        """The blocks this step's tokens filled enter the prefix cache (at the next flush)."""
        block_size = self.block_size
        start = seq._ncached // block_size
        end = (seq._ncached + seq._nsched) // block_size
        if end > start:
            self.defer(seq, start, seq.block_table[start:end])
