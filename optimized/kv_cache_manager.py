"""KV-cache blocks and the prefix cache: the reference BlockManager's decisions on faster machinery.

Invariants (the reference's, spec/invariants.md), true whenever the prefix
cache is read: every block id is either on the free queue (ref count 0) or used
(ref count = number of block tables holding it); ``table[h] == b`` implies block
b carries hash h; a lookup hit also needs equal token bytes; a released block
keeps its hash and contents until it is taken again. What differs from the
reference (spec/optimized-scheduler.md):

* per-block state is flat lists, the free queue is FreeBlockQueue (OPT-4);
  ``_extra[b]`` is a used block's ref count minus one and 0 for every free
  block, so taking a fresh block writes no count and releasing a block held
  once writes none either; a block's contents are empty exactly when its hash
  is -1, so taking a block only resets its hash;
* every free-queue entry before absolute position ``_clean_end`` is a block
  that was never used, so it has no hash and no pending registration: takes
  from there touch nothing but the queue's front (OPT-13);
* chain hashes come from the sequence's own cache, so each full block of a
  sequence is hashed at most once (OPT-5);
* registering full blocks (``hash_blocks``) only appends (sequence, first
  index, block ids) to ``pending``; the log is applied in order (``flush``) before anything
  reads the table or a block's hash: a lookup (``can_allocate``), taking a block
  that has a pending registration, any inspection. The table then holds exactly
  what the reference's eager registrations would have left (OPT-8);
* ``can_allocate`` remembers the walk it made for a waiting sequence and reuses
  it while nothing the walk read has changed (OPT-14).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from xxhash import xxh64_intdigest

from optimized.block_math import blocks_for, needs_new_block
from optimized.free_queue import FreeBlockQueue
from optimized.sequence import Sequence
from reference.block_manager import Block

I64 = npt.NDArray[np.int64]


def chain_hash(contents: bytes, prefix: int) -> int:
    """xxh64 over the previous block's hash (8 bytes LE, omitted when -1) then the token bytes."""
    if prefix == -1:
        return xxh64_intdigest(contents)
    return xxh64_intdigest(prefix.to_bytes(8, "little") + contents)


def token_bytes(seq: Sequence) -> tuple[memoryview, int]:
    """The bytes of the array holding the sequence's tokens (no copy) and the byte offset of its first token."""
    arena = seq._arena
    if arena is not None:
        return arena.bytes_view, 8 * seq.region_offset
    assert seq._own is not None
    return seq._own.data.cast("B"), 0


class WalkMemo:
    """What ``can_allocate`` read for one sequence, kept up to date while it stays valid (OPT-14).

    The walk looked up the chain hashes ``hashes`` (hash -> first index; the
    hits and the one that missed) and compared the contents of ``blocks``
    (block -> index); ``cached`` hits, ``held[i]`` says whether hit i is used.
    Taking hit i (its table entry goes) cuts the walk to i hits; releasing a
    used hit makes it free; anything else that touches a hash or block named
    here drops the memo.
    """

    __slots__ = ("blocks", "cached", "hashes", "held", "seq", "used")

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.cached = 0
        self.used = 0
        self.hashes: dict[int, int] = {}
        self.blocks: dict[int, int] = {}
        self.held: list[bool] = []

    def cut(self, index: int) -> None:
        """Hit ``index`` lost its table entry: the walk now stops there."""
        if index < self.cached:
            self.cached = index
            del self.held[index:]
            self.used = sum(self.held)

    def freed(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            index = self.blocks.get(block_id, -1)
            if 0 <= index < self.cached and self.held[index]:
                self.held[index] = False
                self.used -= 1


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._extra = [0] * num_blocks
        self._shared = 0  # blocks with _extra > 0
        self._hashes = [-1] * num_blocks
        self._contents = [b""] * num_blocks
        self._table: dict[int, int] = {}
        self.free = FreeBlockQueue(num_blocks)
        self._clean_end = num_blocks
        # (seq, first index, block ids) from prefill; (None, indices, block ids, seqs): one decode step's fills.
        self.pending: list[tuple[Any, ...]] = []
        self._memo: WalkMemo | None = None

    # --- read-only views in the reference's vocabulary (each flushes first) --------------------------
    @property
    def ref_counts(self) -> list[int]:
        free = self.free
        return [0 if free.contains(b) else e + 1 for b, e in enumerate(self._extra)]

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
        if self._hashes[block_id] == -1:
            return []
        raw = self._contents[block_id]
        return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8)]

    @property
    def blocks(self) -> list[Block]:
        """Copies as reference Blocks (for inspection; O(num_blocks))."""
        out = []
        refs = self.ref_counts
        for b in range(self.num_blocks):
            block = Block(b)
            block.ref_count = refs[b]
            block.hash = self.block_hash(b)
            block.token_ids = self.token_ids_of(b)
            out.append(block)
        return out

    # --- hashes ---------------------------------------------------------------------------------------
    def extend_chain(self, seq: Sequence, end: int) -> None:
        """Chain hashes of full blocks [len(seq._hashes), end) of ``seq``, each computed once (OPT-5)."""
        chain = seq._hashes
        i = len(chain)
        if i >= end:
            return
        width = 8 * self.block_size
        view, at = token_bytes(seq)
        raw = view[at + i * width : at + end * width].tobytes()
        append = chain.append
        first = 0
        if i == 0:
            prev = xxh64_intdigest(raw[:width])
            append(prev)
            first = width
        else:
            prev = chain[i - 1]
        to_bytes = int.to_bytes
        for k in range(first, len(raw), width):
            prev = xxh64_intdigest(to_bytes(prev, 8, "little") + raw[k : k + width])
            append(prev)

    def chain_hash_of(self, seq: Sequence, i: int) -> int:
        """The chain hash of full block i of ``seq``, computed at most once per sequence (OPT-5)."""
        self.extend_chain(seq, i + 1)
        return seq._hashes[i]

    def defer(self, seq: Sequence, start: int, block_ids: list[int]) -> None:
        """Blocks start, start+1, ... of ``seq`` (held in ``block_ids``) just became full: register them later."""
        self.pending.append((seq, start, block_ids))

    def defer_fills(self, seqs: list[Sequence]) -> None:
        """One decode step filled the last block of each of ``seqs``: register those blocks later."""
        tables = [s.block_table for s in seqs]
        self.pending.append((None, [len(t) - 1 for t in tables], [t[-1] for t in tables], seqs))

    def flush(self) -> None:
        """Apply the pending registrations in order: store hash and contents, map the hash to the block.

        The reference chains from the hash stored on the previous block of the table; that block
        holds this sequence's block i-1 (filled by it, or a cache hit on equal tokens), so its hash
        is this sequence's chain hash i-1, which is what ``extend_chain`` computed (OPT-5).
        """
        pending = self.pending
        if not pending:
            return
        for entry in pending:
            if entry[0] is None:
                self._register_fills(*entry[1:])
            else:
                self._register(*entry)
        pending.clear()

    def _register_fills(self, indices: list[int], block_ids: list[int], seqs: list[Sequence]) -> None:
        """One decode step's fills: block ``indices[k]`` of ``seqs[k]`` is ``block_ids[k]``, just filled."""
        hashes, contents, table, memo = self._hashes, self._contents, self._table, self._memo
        width = 8 * self.block_size
        to_bytes = int.to_bytes
        for seq, i, block_id in zip(seqs, indices, block_ids, strict=True):
            chain = seq._hashes
            arena = seq._arena
            if arena is not None:
                at = 8 * seq.region_offset + i * width
                piece = arena.bytes_view[at : at + width].tobytes()
            else:
                view, at = token_bytes(seq)
                piece = view[at + i * width : at + (i + 1) * width].tobytes()
            n = len(chain)
            if n > i:
                h = chain[i]
            else:
                if n < i:
                    self.extend_chain(seq, i)
                h = xxh64_intdigest(to_bytes(chain[i - 1], 8, "little") + piece) if i else xxh64_intdigest(piece)
                chain.append(h)
            hashes[block_id] = h
            contents[block_id] = piece
            table[h] = block_id
            if memo is not None and (h in memo.hashes or block_id in memo.blocks):
                memo = self._memo = None

    def _register(self, seq: Sequence, start: int, block_ids: list[int]) -> None:
        hashes, contents, table = self._hashes, self._contents, self._table
        width = 8 * self.block_size
        end = start + len(block_ids)
        self.extend_chain(seq, end)
        chain = seq._hashes[start:end]
        view, at = token_bytes(seq)
        raw = view[at + start * width : at + end * width].tobytes()
        k = 0
        for block_id, h in zip(block_ids, chain, strict=True):
            hashes[block_id] = h
            contents[block_id] = raw[k : k + width]
            k += width
        table.update(zip(chain, block_ids, strict=True))
        memo = self._memo
        if memo is not None and not (memo.hashes.keys().isdisjoint(chain) and
                                     memo.blocks.keys().isdisjoint(block_ids)):
            self._memo = None

    # --- taking and releasing blocks ------------------------------------------------------------------
    def take_fresh(self) -> int:
        return self.take_fresh_many(1)[0]

    def take_fresh_many(self, m: int) -> list[int]:
        """The reference's ``_allocate_block`` m times over: the m front ids, in order (OPT-4).

        Entries before ``_clean_end`` are never-used blocks: no hash to forget, nothing pending (OPT-13).
        """
        free = self.free
        ids = free.take(m)
        if free.front > self._clean_end:
            self._forget(ids)
        return ids

    def _forget(self, ids: list[int]) -> None:
        """Taken blocks lose their hash (and their table entry, if it still names them)."""
        if self.pending:
            self.flush()  # a taken block's pending registration must land first, as the reference's was eager
        hashes, table, memo = self._hashes, self._table, self._memo
        for block_id in ids:
            h = hashes[block_id]
            if h != -1:
                # Distinct blocks carry distinct mapped hashes: the order of these deletions is immaterial.
                if table.get(h) == block_id:
                    del table[h]
                    if memo is not None:
                        index = memo.hashes.get(h)
                        if index is not None:
                            memo.cut(index)
                hashes[block_id] = -1

    def release(self, table: list[int]) -> None:
        """``deallocate``'s release: from the table's end to its start, freed ids join the queue in that order."""
        extra = self._extra
        if self._shared and any(map(extra.__getitem__, table)):
            freed = []
            for block_id in reversed(table):
                if extra[block_id]:
                    extra[block_id] -= 1
                    if not extra[block_id]:
                        self._shared -= 1
                else:
                    freed.append(block_id)
        else:  # held by this table alone: every block goes back
            freed = table[::-1]
        if freed:
            if self._memo is not None:
                self._memo.freed(freed)
            self.free.extend(freed)

    def forget_walk(self, seq: Sequence) -> None:
        """``seq`` leaves the scheduler: a walk remembered for it is of no further use."""
        if self._memo is not None and self._memo.seq is seq:
            self._memo = None

    def deallocate(self, seq: Sequence) -> None:
        """Release the table from its end to its start; the freed ids join the queue in that order."""
        self.release(seq.block_table)
        seq._ncached = 0
        seq.block_table.clear()

    # --- the reference's BlockManager API, on sequences outside the decode group ----------------------
    def can_allocate(self, seq: Sequence) -> int:
        """-1 when the free queue cannot cover the sequence, else its cached-block count."""
        self.flush()
        memo = self._memo
        if memo is None or memo.seq is not seq:
            memo = self._walk(seq)
        if self.free.count < blocks_for(seq._ntok, self.block_size) - memo.used:
            return -1
        return memo.cached

    def _walk(self, seq: Sequence) -> WalkMemo:
        """The reference's lookup walk over the sequence's full blocks but its last."""
        block_size = self.block_size
        num_blocks = blocks_for(seq._ntok, block_size)
        self.extend_chain(seq, num_blocks - 1)
        table, contents = self._table, self._contents
        slot, front = self.free.slots(), self.free.front
        chain = seq._hashes
        width = 8 * block_size
        view, at = token_bytes(seq)
        raw = view[at : at + (num_blocks - 1) * width].tobytes()
        memo = WalkMemo(seq)
        looked, compared, held = memo.hashes, memo.blocks, memo.held
        for i in range(num_blocks - 1):
            h = chain[i]
            looked.setdefault(h, i)
            block_id = table.get(h, -1)
            if block_id == -1:
                break
            compared.setdefault(block_id, i)
            if contents[block_id] != raw[i * width : (i + 1) * width]:
                break
            held.append(slot[block_id] < front)
        memo.cached = len(held)
        memo.used = sum(held)
        self._memo = memo
        return memo

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        assert not seq.block_table
        table, extra, free = self._table, self._extra, self.free
        chain = seq._hashes
        block_table = seq.block_table
        for i in range(num_cached_blocks):
            block_id = table[chain[i]]  # can_allocate flushed and computed these hashes
            if free.contains(block_id):
                free.remove(block_id)
            else:
                if not extra[block_id]:
                    self._shared += 1
                extra[block_id] += 1
            block_table.append(block_id)
        self._memo = None
        num_blocks = blocks_for(seq._ntok, self.block_size)
        block_table.extend(self.take_fresh_many(num_blocks - num_cached_blocks))
        seq._ncached = num_cached_blocks * self.block_size

    def can_append(self, seq: Sequence) -> bool:
        return self.free.count >= needs_new_block(seq._ntok, self.block_size)

    def may_append(self, seq: Sequence) -> None:
        if needs_new_block(seq._ntok, self.block_size):
            seq.block_table.append(self.take_fresh())

    def hash_blocks(self, seq: Sequence) -> None:
        """The blocks this step's tokens filled enter the prefix cache (at the next flush)."""
        block_size = self.block_size
        start = seq._ncached // block_size
        end = (seq._ncached + seq._nsched) // block_size
        if end > start:
            self.defer(seq, start, seq.block_table[start:end])
