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
    (block -> index); the first ``cached`` of ``hits`` are the blocks it hit,
    ``held[i]`` says whether hit i is used.
    Taking hit i (its table entry goes) cuts the walk to i hits; releasing a
    used hit makes it free; anything else that touches a hash or block named
    here drops the memo.
    """

    __slots__ = ("blocks", "cached", "hashes", "held", "hits", "seq", "used")

    def __init__(self, seq: Sequence, hits: list[int], held: list[bool], hashes: dict[int, int],
                 blocks: dict[int, int]) -> None:
        self.seq = seq
        self.hits = hits
        self.held = held
        self.cached = len(hits)
        self.used = sum(held)
        self.hashes = hashes
        self.blocks = blocks

    def reads(self, h: int, block_id: int) -> bool:
        """Whether mapping ``h`` or changing ``block_id`` could change the walk's answer.

        Entries past the walk's end (left by ``cut``) are ignored: the walk no longer reaches them.
        """
        cached = self.cached
        return self.hashes.get(h, cached + 1) <= cached or self.blocks.get(block_id, cached + 1) <= cached

    def cut(self, index: int) -> None:
        """Hit ``index`` lost its table entry: the walk now stops there."""
        if index < self.cached:
            self.cached = index
            del self.held[index:]
            self.used = sum(self.held)

    def freed(self, block_ids: list[int]) -> None:
        """These blocks went back to the free queue: a hit among them is no longer used."""
        if self.blocks.keys().isdisjoint(block_ids):
            return
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
        # (seq, first index, block ids) from hash_blocks; (None, clock, seqs): one decode step's fills.
        self.pending: list[tuple[Any, ...]] = []
        self._memo: WalkMemo | None = None
        self._chain_source: Sequence | None = None  # the last sequence whose chain was hashed from its start

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
        """Chain hashes of full blocks [len(seq._hashes), end) of ``seq``, each computed once (OPT-5).

        The blocks' bytes are kept beside the hashes (``seq._pieces``) for the registration to
        store. A chain hash is a function of the bytes of the blocks up to its own, so when a
        sequence starts with the same full blocks as the last one hashed from its start (a shared
        system prompt), it takes those hashes instead of computing them (OPT-16).
        """
        chain, pieces = seq._hashes, seq._pieces
        i = len(chain)
        if i >= end:
            return
        width = 8 * self.block_size
        view, at = token_bytes(seq)
        raw = view[at + i * width : at + end * width].tobytes()
        fresh = [raw[k : k + width] for k in range(0, len(raw), width)]
        if i == 0:
            shared = self._shared_start(seq, raw, fresh[0])
            if shared:
                pieces.extend(fresh[:shared])
                del fresh[:shared]
                i = shared
        pieces.extend(fresh)
        append = chain.append
        if i == 0:
            prev = xxh64_intdigest(fresh[0])
            append(prev)
            del fresh[0]
        else:
            prev = chain[i - 1]
        to_bytes = int.to_bytes
        for piece in fresh:
            prev = xxh64_intdigest(to_bytes(prev, 8, "little") + piece)
            append(prev)

    def _shared_start(self, seq: Sequence, raw: bytes, first: bytes) -> int:
        """Copy into ``seq``'s empty chain the hashes of its leading blocks equal to the last chained sequence's."""
        source = self._chain_source
        self._chain_source = seq
        if source is None or source is seq or not source._pieces or source._pieces[0] != first:
            return 0  # the usual case without a shared prefix: one block compared
        known = source._hashes
        m = min(len(raw) // len(first), len(known), len(source._pieces))
        width = len(first)
        theirs = b"".join(source._pieces[:m])
        if raw[: m * width] == theirs:
            k = m
        else:  # the longest run of equal leading blocks: raw[:lo] equal, raw[:hi] not
            lo, hi = 1, m
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if raw[: mid * width] == theirs[: mid * width]:
                    lo = mid
                else:
                    hi = mid
            k = lo
        seq._hashes.extend(known[:k])
        return k

    def chain_hash_of(self, seq: Sequence, i: int) -> int:
        """The chain hash of full block i of ``seq``, computed at most once per sequence (OPT-5)."""
        self.extend_chain(seq, i + 1)
        return seq._hashes[i]

    def defer(self, seq: Sequence, start: int, block_ids: list[int]) -> None:
        """Blocks start, start+1, ... of ``seq`` (held in ``block_ids``) just became full: register them later."""
        self.pending.append((seq, start, block_ids))

    def defer_fills(self, clock: int, seqs: list[Sequence]) -> None:
        """Decode step ``clock`` filled the last block of each of ``seqs``: register those blocks later.

        Only the step is logged: which block that was is read back at the flush from the member's
        segment for that clock (``Sequence._segments``), whose table list deallocate leaves intact.
        """
        self.pending.append((None, clock, seqs))

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
                self._register_fills(entry[1], entry[2])
            else:
                self._register(*entry)
        pending.clear()

    def _register_fills(self, clock: int, seqs: list[Sequence]) -> None:
        """Decode step ``clock``'s fills: each member's block holding its token ``length - 1`` just filled."""
        hashes, contents, table, memo = self._hashes, self._contents, self._table, self._memo
        block_size = self.block_size
        width = 8 * block_size
        to_bytes = int.to_bytes
        for seq in seqs:
            segments = seq._segments
            k = len(segments) - 1
            while segments[k][0] > clock:
                k -= 1
            _, anchor, block_table = segments[k]
            i = (anchor + clock) // block_size - 1
            block_id = block_table[i]
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
                seq._pieces.append(piece)
            hashes[block_id] = h
            contents[block_id] = piece
            table[h] = block_id
            if memo is not None and memo.reads(h, block_id):
                memo = self._memo = None

    def _register(self, seq: Sequence, start: int, block_ids: list[int]) -> None:
        hashes, contents = self._hashes, self._contents
        end = start + len(block_ids)
        self.extend_chain(seq, end)
        chain = seq._hashes[start:end]
        pieces = seq._pieces[start:end]
        for block_id, h, piece in zip(block_ids, chain, pieces, strict=True):
            hashes[block_id] = h
            contents[block_id] = piece
        self._table.update(zip(chain, block_ids, strict=True))
        memo = self._memo
        if memo is not None and self._touches(memo, chain, block_ids):
            self._memo = None

    @staticmethod
    def _touches(memo: WalkMemo, chain: list[int], block_ids: list[int]) -> bool:
        """Whether registering these hashes on these blocks could change the remembered walk."""
        if memo.hashes.keys().isdisjoint(chain) and memo.blocks.keys().isdisjoint(block_ids):
            return False
        return any(map(memo.reads, chain, block_ids))

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
        """``deallocate``'s release: from the table's end to its start, freed ids join the queue in that order.

        A block with ``_extra`` 0 is held by this table alone and goes back; the others lose one holder.
        """
        extra = self._extra
        freed = table[::-1]
        if self._shared:
            counts = list(map(extra.__getitem__, table))
            shared = len(counts) - counts.count(0)
            if shared:
                if counts.index(0) == shared if shared < len(counts) else True:
                    freed = freed[: len(counts) - shared]  # the usual shape: a shared prefix, then its own blocks
                    held = table[:shared]
                else:
                    held = [b for b in table if extra[b]]
                    freed = [b for b in freed if not extra[b]]
                for block_id in held:
                    extra[block_id] -= 1
                    if not extra[block_id]:
                        self._shared -= 1
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
        seq.block_table = []  # a new list: a pending decode fill may still read the old one (defer_fills)

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
        last = blocks_for(seq._ntok, block_size) - 1
        self.extend_chain(seq, last)
        table_get, contents = self._table.get, self._contents
        chain = seq._hashes
        width = 8 * block_size
        view, at = token_bytes(seq)
        raw = view[at : at + last * width].tobytes()
        hits: list[int] = []
        missed = -1
        for i in range(last):
            block_id = table_get(chain[i], -1)
            if block_id == -1 or contents[block_id] != raw[i * width : (i + 1) * width]:
                missed = block_id
                break
            hits.append(block_id)
        m = len(hits)
        if m == 0:  # the usual first walk of a new prompt: nothing cached
            hashes = {chain[0]: 0} if last else {}
            blocks = {missed: 0} if missed != -1 else {}
            memo = self._memo = WalkMemo(seq, hits, [], hashes, blocks)
            return memo
        looked = chain[: m + 1] if m < last else chain[:m]
        # Built backwards so that a repeated hash or block keeps its first index.
        hashes = dict(zip(reversed(looked), range(len(looked) - 1, -1, -1), strict=True))
        blocks = dict(zip(reversed(hits), range(m - 1, -1, -1), strict=True))
        if missed != -1:
            blocks.setdefault(missed, m)
        slot, front = self.free.slots(), self.free.front
        memo = self._memo = WalkMemo(seq, hits, [slot[b] < front for b in hits], hashes, blocks)
        return memo

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        """Take the walk's first ``num_cached_blocks`` hits (can_allocate just walked for ``seq``), then fresh ones."""
        assert not seq.block_table
        memo = self._memo
        assert memo is not None and memo.seq is seq and num_cached_blocks <= memo.cached
        hits = memo.hits[:num_cached_blocks]
        extra, free = self._extra, self.free
        slot, front = free.slots(), free.front
        for block_id in hits:
            if slot[block_id] >= front:  # free: revived where it stands
                free.remove(block_id)
            else:
                if not extra[block_id]:
                    self._shared += 1
                extra[block_id] += 1
        self._memo = None
        block_table = seq.block_table
        block_table.extend(hits)
        block_table.extend(self.take_fresh_many(blocks_for(seq._ntok, self.block_size) - num_cached_blocks))
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
