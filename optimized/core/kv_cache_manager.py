"""KV-cache blocks and the prefix cache: the reference BlockManager's decisions on faster machinery.

Invariants (the reference's, spec/invariants.md), true whenever the prefix
cache is read: every block id is either on the free queue (ref count 0) or used
(ref count = number of block tables holding it); ``table[h] == b`` implies block
b carries hash h; a lookup hit also needs equal token bytes; a released block
keeps its hash and contents until it is taken again. What differs from the
reference (spec/optimized-scheduler.md):

* which blocks are free and how many tables hold each used one is the
  ``BlockPool``'s (block_pool.py: OPT-6, OPT-14); this class is the prefix
  cache over it, and forgets a taken block's hash only when the take reaches
  past the pool's never-used blocks; ``_hashes`` and ``_contents`` (dicts)
  hold the registered blocks only, so a registration is three dict updates and
  taking a block pops its entries;
* chain hashes come from the sequence's own cache, so each full block of a
  sequence is hashed at most once (OPT-7);
* registering full blocks (``hash_blocks``) only appends a ``FullBlocks``
  entry (sequence, first index, block ids) to ``pending``, and a decode step's
  fills only a ``DecodeFills`` (clock, members) (OPT-17); the log is applied in order (``flush``) before anything
  reads the table or a block's hash: a lookup (``can_allocate``), taking a block
  from beyond the pool's never-used blocks, any inspection. The table then holds exactly
  what the reference's eager registrations would have left (OPT-8);
* ``can_allocate`` remembers the walk it made for a waiting sequence
  (walk_memo.py) and reuses it while nothing the walk read has changed (OPT-15);
* every chain hash is computed by ``chain_hash``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from xxhash import xxh64_intdigest

from invariants.block_math import blocks_for, needs_new_block
from optimized.core.block_pool import BlockPool
from optimized.core.sequence import Sequence
from optimized.core.walk_memo import WalkMemo

I64 = npt.NDArray[np.int64]


def chain_hash(prefix: int, piece: bytes) -> int:
    """The prefix-cache chain hash of one block's token bytes: xxh64 over the previous block's hash (8 bytes
    little-endian; nothing before a sequence's first block, ``prefix == -1``) then the bytes. The one place the
    chain hash is computed."""
    return xxh64_intdigest(prefix.to_bytes(8, "little") + piece if prefix != -1 else piece)


def chain_hashes(prefix: int, pieces: Iterable[bytes]) -> list[int]:
    """``chain_hash`` of each block in turn, each chained on the one before."""
    out: list[int] = []
    for piece in pieces:
        prefix = chain_hash(prefix, piece)
        out.append(prefix)
    return out


@dataclass(frozen=True, slots=True)
class FullBlocks:
    """A pending registration from ``hash_blocks``: blocks ``start, start+1, ...`` of ``seq``, held in ``block_ids``."""

    seq: Sequence
    start: int
    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class DecodeFills:
    """A pending registration of one decode step: at clock ``clock`` the last block of each of ``seqs`` filled.

    Which block that was is read back at the flush from the member's segment covering ``clock`` (OPT-17).
    """

    clock: int
    seqs: list[Sequence]


def token_bytes(seq: Sequence) -> tuple[memoryview, int]:
    """The bytes of the array holding the sequence's tokens (no copy) and the byte offset of its first token."""
    arena = seq.core.arena
    if arena is not None:
        return arena.bytes_view, 8 * seq.core.region_offset
    assert seq.core.own is not None
    return seq.core.own.data.cast("B"), 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.free = self.pool.free  # the pool's free queue, read on the scheduler's decode path
        # Registered blocks only (a block without an entry has hash -1 and no tokens): dicts, so that a
        # registration of a run of blocks is three C-level updates.
        self._hashes: dict[int, int] = {}
        self._contents: dict[int, bytes] = {}
        self._table: dict[int, int] = {}
        self.pending: list[FullBlocks | DecodeFills] = []  # applied in order by flush (OPT-8, OPT-17)
        self._memo: WalkMemo | None = None
        self._chain_source: Sequence | None = None  # the last sequence whose chain was hashed from its start
        self._common: tuple[Sequence | None, bytes] = (None, b"")  # a sequence and bytes it starts with

    # --- read-only views in the reference's vocabulary (each flushes first) --------------------------
    @property
    def ref_counts(self) -> list[int]:
        return self.pool.ref_counts

    @property
    def hash_to_block_id(self) -> dict[int, int]:
        self.flush()
        return dict(self._table)

    @property
    def free_block_ids(self) -> list[int]:
        return self.pool.free_block_ids

    @property
    def used_block_ids(self) -> set[int]:
        return self.pool.used_block_ids

    # --- one block at a time (the scheduler port's BlockReader, ARCH-4) ---------------------------------
    @property
    def num_free(self) -> int:
        return self.free.count

    def is_used(self, block_id: int) -> bool:
        return not self.free.contains(block_id)

    def ref_count(self, block_id: int) -> int:
        return self.pool.ref_count(block_id)

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
        """Chain hashes of full blocks [len(seq.core.hashes), end) of ``seq``, each computed once (OPT-7).

        The blocks' bytes are kept beside the hashes (``seq.core.pieces``) for the walk to compare and
        the registration to store. A chain hash is a function of the bytes of the blocks up to its
        own, so when a sequence starts with the same full blocks as the last one hashed from its
        start (a shared system prompt), it takes those hashes instead of computing them (OPT-16).
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
        chain.extend(chain_hashes(chain[i - 1] if i else -1, fresh))

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
        """The chain hash of full block i of ``seq``, computed at most once per sequence (OPT-7)."""
        self.extend_chain(seq, i + 1)
        return seq.core.hashes[i]

    def defer(self, seq: Sequence, start: int, block_ids: list[int]) -> None:
        """Blocks start, start+1, ... of ``seq`` (held in ``block_ids``) just became full: register them later."""
        self.pending.append(FullBlocks(seq, start, block_ids))

    def defer_fills(self, clock: int, seqs: list[Sequence]) -> None:
        """Decode step ``clock`` filled the last block of each of ``seqs``: register those blocks later.

        Only the step is logged: which block that was is read back at the flush from the member's
        segment for that clock (``CoreState.segments``), whose table list deallocate leaves intact.
        """
        self.pending.append(DecodeFills(clock, seqs))

    def flush(self) -> None:
        """Apply the pending registrations in order: store hash and contents, map the hash to the block.

        The reference chains from the hash stored on the previous block of the table; that block
        holds this sequence's block i-1 (filled by it, or a cache hit on equal tokens), so its hash
        is this sequence's chain hash i-1, which is what ``extend_chain`` computed (OPT-7).
        """
        pending = self.pending
        if not pending:
            return
        for entry in pending:
            if type(entry) is DecodeFills:
                self._register_fills(entry.clock, entry.seqs)
            else:
                assert type(entry) is FullBlocks
                self._register(entry.seq, entry.start, entry.block_ids)
        pending.clear()

    def _register_fills(self, clock: int, seqs: list[Sequence]) -> None:
        """Decode step ``clock``'s fills: each member's block holding its token ``length - 1`` just filled."""
        hashes, contents, table, memo = self._hashes, self._contents, self._table, self._memo
        block_size = self.block_size
        width = 8 * block_size
        new_hashes: list[int] = []
        for seq in seqs:
            core = seq.core
            segments = core.segments
            k = len(segments) - 1
            while segments[k][0] > clock:
                k -= 1
            _, anchor, block_table = segments[k]
            i = (anchor + clock) // block_size - 1
            block_id = block_table[i]
            chain = core.hashes
            arena = core.arena
            if arena is not None:
                at = 8 * core.region_offset + i * width
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
                h = chain_hash(chain[i - 1] if i else -1, piece)
                chain.append(h)
                core.pieces.append(piece)
            hashes[block_id] = h
            contents[block_id] = piece
            table[h] = block_id
            new_hashes.append(h)
        if memo is not None and self._touches(memo, new_hashes):
            self._memo = None

    def _register(self, seq: Sequence, start: int, block_ids: list[int]) -> None:
        end = start + len(block_ids)
        self.extend_chain(seq, end)
        chain = seq.core.hashes[start:end]
        self._hashes.update(zip(block_ids, chain, strict=True))
        self._contents.update(zip(block_ids, seq.core.pieces[start:end], strict=True))
        self._table.update(zip(chain, block_ids, strict=True))
        memo = self._memo
        if memo is not None and self._touches(memo, chain):
            self._memo = None

    @staticmethod
    def _touches(memo: WalkMemo, chain: list[int]) -> bool:
        """Whether mapping these hashes could change the remembered walk."""
        return not memo.hashes.keys().isdisjoint(chain) and any(map(memo.reads, chain))

    # --- taking and releasing blocks ------------------------------------------------------------------
    def take_fresh(self) -> int:
        return self.take_fresh_many(1)[0]

    def take_fresh_many(self, m: int) -> list[int]:
        """The reference's ``_allocate_block`` m times over: the m front ids, in order (OPT-6).

        Entries before the pool's ``clean_end`` are never-used blocks: no hash to forget, nothing pending
        (OPT-14).
        """
        free = self.free
        ids = free.take(m)
        if free.front > self.pool.clean_end:
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
        """``deallocate``'s release (the pool's); a remembered walk learns which of its hits went free."""
        freed = self.pool.release(table)
        if freed and self._memo is not None:
            self._memo.freed(freed)

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
        """The reference's lookup walk over the sequence's full blocks but its last, remembered (OPT-15)."""
        memo = self._memo = self._fresh_walk(seq)
        return memo

    def stale_walk(self) -> str:
        """"" while the remembered walk is the one a fresh walk would make now; else what differs (OPT-15).

        For a checker (the differential machine): it flushes and hashes, as a lookup would, and keeps the memo.
        """
        self.flush()
        memo = self._memo
        if memo is None:
            return ""
        kept = (memo.hits[: memo.cached], memo.held[: memo.cached], memo.used)
        fresh = self._fresh_walk(memo.seq)
        if kept == (fresh.hits, fresh.held, fresh.used):
            return ""
        return (f"OPT-15: the walk remembered for sequence {memo.seq.seq_id} (hits, held, used) {kept} is not a "
                f"fresh walk's {(fresh.hits, fresh.held, fresh.used)}")

    def _fresh_walk(self, seq: Sequence) -> WalkMemo:
        block_size = self.block_size
        last = blocks_for(seq.core.ntok, block_size) - 1
        # Hash only what the walk reads: the first block, and the rest once the first one hits (the
        # registration hashes the others later, if anything ever reads them).
        self.extend_chain(seq, min(last, 1))
        table = self._table
        chain, pieces = seq.core.hashes, seq.core.pieces
        hits: list[int] = []
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
        m = len(hits)
        looked = chain[: m + 1] if m < last else chain[:m]
        held = self.pool.held(hits) if m else []
        return WalkMemo(seq, hits, held, looked)

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        """Take the walk's first ``num_cached_blocks`` hits (can_allocate just walked for ``seq``), then fresh ones."""
        assert not seq.block_table
        memo = self._memo
        assert memo is not None and memo.seq is seq and num_cached_blocks <= memo.cached
        hits = memo.hits[:num_cached_blocks]
        # Hits repeat a block only after a hash collision (two chain positions, one hash): the slow path then.
        self.pool.hold(hits, num_cached_blocks == memo.cached and memo.used == len(hits) == len(set(hits)))
        self._memo = None
        block_table = seq.block_table
        block_table.extend(hits)
        block_table.extend(self.take_fresh_many(blocks_for(seq.core.ntok, self.block_size) - num_cached_blocks))
        seq.core.ncached = num_cached_blocks * self.block_size

    def can_append(self, seq: Sequence) -> bool:
        return self.free.count >= needs_new_block(seq.core.ntok, self.block_size)

    def hash_blocks(self, seq: Sequence) -> None:
        """The blocks this step's tokens filled enter the prefix cache (at the next flush)."""
        block_size = self.block_size
        start = seq.core.ncached // block_size
        end = (seq.core.ncached + seq.core.nsched) // block_size
        if end > start:
            self.defer(seq, start, seq.block_table[start:end])
