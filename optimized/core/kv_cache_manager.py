"""KV-cache blocks and the prefix cache: the reference BlockManager's decisions on faster machinery.

Invariants (the reference's, spec/invariants.md), true whenever the prefix
cache is read: every block id is either on the free queue (ref count 0) or used
(ref count = number of block tables holding it); ``table[h] == b`` implies block
b carries hash h; a lookup hit also needs equal token bytes; a released block
keeps its hash and contents until it is taken again. What differs from the
reference (spec/optimized-scheduler.md):

* the free queue is FreeBlockQueue (OPT-4); ``_extra[b]`` (a list) is a used
  block's ref count minus one and 0 for every free block, so taking a fresh
  block writes no count and releasing a block held once writes none either;
  ``_shared`` counts the blocks with ``_extra > 0``; ``_hashes`` and
  ``_contents`` (dicts) hold the registered blocks only, so a registration is
  three dict updates and taking a block pops its entries;
* every free-queue entry before absolute position ``_clean_end`` is a block
  that was never used, so it has no hash and no pending registration: takes
  from there touch nothing but the queue's front (OPT-13);
* chain hashes come from the sequence's own cache, so each full block of a
  sequence is hashed at most once (OPT-5);
* registering full blocks (``hash_blocks``) only appends (sequence, first
  index, block ids) to ``pending``, and a decode step's fills only (clock,
  members) (OPT-16); the log is applied in order (``flush``) before anything
  reads the table or a block's hash: a lookup (``can_allocate``), taking a block
  from beyond ``_clean_end``, any inspection. The table then holds exactly
  what the reference's eager registrations would have left (OPT-8);
* ``can_allocate`` remembers the walk it made for a waiting sequence and reuses
  it while nothing the walk read has changed (OPT-14).
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

import numpy as np
import numpy.typing as npt
from xxhash import xxh64_intdigest

from invariants.block_math import blocks_for, needs_new_block
from optimized.core.free_queue import FreeBlockQueue
from optimized.core.sequence import Sequence

I64 = npt.NDArray[np.int64]


def chain_hash(contents: bytes, prefix: int) -> int:
    """xxh64 over the previous block's hash (8 bytes LE, omitted when -1) then the token bytes."""
    if prefix == -1:
        return xxh64_intdigest(contents)
    return xxh64_intdigest(prefix.to_bytes(8, "little") + contents)


def token_bytes(seq: Sequence) -> tuple[memoryview, int]:
    """The bytes of the array holding the sequence's tokens (no copy) and the byte offset of its first token."""
    arena = seq.core.arena
    if arena is not None:
        return arena.bytes_view, 8 * seq.core.region_offset
    assert seq.core.own is not None
    return seq.core.own.data.cast("B"), 0


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

    __slots__ = ("_blocks", "_hashes", "cached", "held", "hits", "looked", "missed", "seq", "used")

    def __init__(self, seq: Sequence, hits: list[int], held: list[bool], looked: list[int], missed: int) -> None:
        self.seq = seq
        self.hits = hits
        self.held = held
        self.cached = len(hits)
        self.used = sum(held)
        self.looked = looked
        self.missed = missed
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
            blocks = dict(zip(reversed(hits), range(len(hits) - 1, -1, -1), strict=True))
            if self.missed != -1:
                blocks.setdefault(self.missed, len(hits))
            self._blocks = blocks
        return self._blocks

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
        # Registered blocks only (a block without an entry has hash -1 and no tokens): dicts, so that a
        # registration of a run of blocks is three C-level updates.
        self._hashes: dict[int, int] = {}
        self._contents: dict[int, bytes] = {}
        self._table: dict[int, int] = {}
        self.free = FreeBlockQueue(num_blocks)
        self._clean_end = num_blocks
        # (seq, first index, block ids) from hash_blocks; (None, clock, seqs): one decode step's fills.
        self.pending: list[tuple[Any, ...]] = []
        self._memo: WalkMemo | None = None
        self._chain_source: Sequence | None = None  # the last sequence whose chain was hashed from its start
        self._common: tuple[Sequence | None, bytes] = (None, b"")  # a sequence and bytes it starts with

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
        return self._hashes.get(block_id, -1)

    def token_ids_of(self, block_id: int) -> list[int]:
        self.flush()
        raw = self._contents.get(block_id)
        if raw is None:
            return []
        return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8)]

    # --- hashes ---------------------------------------------------------------------------------------
    def extend_chain(self, seq: Sequence, end: int) -> None:
        """Chain hashes of full blocks [len(seq.core.hashes), end) of ``seq``, each computed once (OPT-5).

        The blocks' bytes are kept beside the hashes (``seq.core.pieces``) for the walk to compare and
        the registration to store. A chain hash is a function of the bytes of the blocks up to its
        own, so when a sequence starts with the same full blocks as the last one hashed from its
        start (a shared system prompt), it takes those hashes instead of computing them (OPT-15).
        """
        chain, pieces = seq.core.hashes, seq.core.pieces
        i = len(chain)
        if i >= end:
            return
        width = 8 * self.block_size
        view, at = token_bytes(seq)
        if i == 0:
            # The shared run is looked for over every full block the sequence had when it was added (it
            # may be longer than ``end``); only what is past it is hashed, up to ``end``.
            full = max(end, seq.core.ntok // self.block_size)
            raw = view[at : at + full * width].tobytes()
            i = self._shared_start(seq, raw, full)
            if i >= end:
                return
            raw = raw[i * width : end * width]
        else:
            raw = view[at + i * width : at + end * width].tobytes()
        fresh = [raw[k : k + width] for k in range(0, len(raw), width)]
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

    def _shared_start(self, seq: Sequence, raw: bytes, end: int) -> int:
        """Give ``seq``'s empty chain the hashes and bytes of its leading blocks equal to the last chained one's."""
        source = self._chain_source
        self._chain_source = seq
        if source is None or source is seq:
            return 0
        theirs = source.core.pieces
        m = min(end, len(source.core.hashes), len(theirs))
        width = 8 * self.block_size
        owner, common = self._common
        if owner is source and len(common) <= m * width and raw.startswith(common):
            k = known = len(common) // width  # what the source shared with its own source, in one comparison
        else:
            k = known = 0
        while k < m and raw.startswith(theirs[k], k * width):
            k += 1
        if k:
            seq.core.hashes.extend(source.core.hashes[:k])
            seq.core.pieces.extend(theirs[:k])
            # The bytes ``seq`` is now known to start with, for the next sequence to compare at once.
            self._common = (seq, common if k == known else raw[: k * width])
        return k

    def chain_hash_of(self, seq: Sequence, i: int) -> int:
        """The chain hash of full block i of ``seq``, computed at most once per sequence (OPT-5)."""
        self.extend_chain(seq, i + 1)
        return seq.core.hashes[i]

    def defer(self, seq: Sequence, start: int, block_ids: list[int]) -> None:
        """Blocks start, start+1, ... of ``seq`` (held in ``block_ids``) just became full: register them later."""
        self.pending.append((seq, start, block_ids))

    def defer_fills(self, clock: int, seqs: list[Sequence]) -> None:
        """Decode step ``clock`` filled the last block of each of ``seqs``: register those blocks later.

        Only the step is logged: which block that was is read back at the flush from the member's
        segment for that clock (``CoreState.segments``), whose table list deallocate leaves intact.
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
        new_hashes: list[int] = []
        new_blocks: list[int] = []
        for seq in seqs:
            segments = seq.core.segments
            k = len(segments) - 1
            while segments[k][0] > clock:
                k -= 1
            _, anchor, block_table = segments[k]
            i = (anchor + clock) // block_size - 1
            block_id = block_table[i]
            chain = seq.core.hashes
            arena = seq.core.arena
            if arena is not None:
                at = 8 * seq.core.region_offset + i * width
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
                seq.core.pieces.append(piece)
            hashes[block_id] = h
            contents[block_id] = piece
            table[h] = block_id
            new_hashes.append(h)
            new_blocks.append(block_id)
        if memo is not None and self._touches(memo, new_hashes, new_blocks):
            self._memo = None

    def _register(self, seq: Sequence, start: int, block_ids: list[int]) -> None:
        end = start + len(block_ids)
        self.extend_chain(seq, end)
        chain = seq.core.hashes[start:end]
        self._hashes.update(zip(block_ids, chain, strict=True))
        self._contents.update(zip(block_ids, seq.core.pieces[start:end], strict=True))
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
        hashes, contents, table = self._hashes, self._contents, self._table
        unmapped = []
        for block_id in ids:
            h = hashes.pop(block_id, -1)
            if h != -1:
                del contents[block_id]
                # Distinct blocks carry distinct mapped hashes: the order of these deletions is immaterial.
                if table.get(h) == block_id:
                    del table[h]
                    unmapped.append(h)
        memo = self._memo
        if memo is not None and unmapped and not memo.hashes.keys().isdisjoint(unmapped):
            memo.cut(min(memo.hashes.get(h, memo.cached) for h in unmapped))

    def release(self, table: list[int]) -> None:
        """``deallocate``'s release: from the table's end to its start, freed ids join the queue in that order.

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
        seq.core.ncached = 0
        seq.block_table = []  # a new list: a pending decode fill may still read the old one (defer_fills)

    # --- the reference's BlockManager API, on sequences outside the decode group ----------------------
    def can_allocate(self, seq: Sequence) -> int:
        """-1 when the free queue cannot cover the sequence, else its cached-block count."""
        self.flush()
        memo = self._memo
        if memo is None or memo.seq is not seq:
            memo = self._walk(seq)
        if self.free.count < blocks_for(seq.core.ntok, self.block_size) - memo.used:
            return -1
        return memo.cached

    def _walk(self, seq: Sequence) -> WalkMemo:
        """The reference's lookup walk over the sequence's full blocks but its last."""
        block_size = self.block_size
        last = blocks_for(seq.core.ntok, block_size) - 1
        # Hash only what the walk reads: the first block, and the rest once the first one hits (the
        # registration hashes the others later, if anything ever reads them).
        self.extend_chain(seq, min(last, 1))
        table = self._table
        chain, pieces = seq.core.hashes, seq.core.pieces
        hits: list[int] = []
        missed = -1
        if last and chain[0] in table:
            self.extend_chain(seq, last)
            # Every lookup at C speed; the walk ends at the first missing hash or the first other tokens.
            found = list(map(table.get, chain[:last]))
            m = found.index(None) if None in found else last
            hit_ids: list[int] = found[:m]  # type: ignore[assignment]  # no None before m
            stored = list(map(self._contents.get, hit_ids))
            if stored == pieces[:m]:  # element by element; the same bytes object compares at once
                hits = hit_ids
            else:
                j = next(j for j in range(m) if stored[j] != pieces[j])
                hits = hit_ids[:j]
                missed = hit_ids[j]
        m = len(hits)
        looked = chain[: m + 1] if m < last else chain[:m]
        if m:
            slot, front = self.free.slots(), self.free.front
            held = [slot[b] < front for b in hits]
        else:
            held = []
        memo = self._memo = WalkMemo(seq, hits, held, looked, missed)
        return memo

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        """Take the walk's first ``num_cached_blocks`` hits (can_allocate just walked for ``seq``), then fresh ones."""
        assert not seq.block_table
        memo = self._memo
        assert memo is not None and memo.seq is seq and num_cached_blocks <= memo.cached
        hits = memo.hits[:num_cached_blocks]
        extra, free = self._extra, self.free
        if num_cached_blocks == memo.cached and memo.used == len(hits) == len(set(hits)):
            # Every hit is held already (a shared prefix): extra += 1 for each.
            for block_id in hits:
                extra[block_id] += 1
            self._shared += sum(1 for b in hits if extra[b] == 1)
        else:
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
        block_table.extend(self.take_fresh_many(blocks_for(seq.core.ntok, self.block_size) - num_cached_blocks))
        seq.core.ncached = num_cached_blocks * self.block_size

    def can_append(self, seq: Sequence) -> bool:
        return self.free.count >= needs_new_block(seq.core.ntok, self.block_size)

    def may_append(self, seq: Sequence) -> None:
        if needs_new_block(seq.core.ntok, self.block_size):
            seq.block_table.append(self.take_fresh())

    def hash_blocks(self, seq: Sequence) -> None:
        """The blocks this step's tokens filled enter the prefix cache (at the next flush)."""
        block_size = self.block_size
        start = seq.core.ncached // block_size
        end = (seq.core.ncached + seq.core.nsched) // block_size
        if end > start:
            self.defer(seq, start, seq.block_table[start:end])
