"""The decode batch kept from step to step, advanced by a clock instead of per-sequence writes.

Invariants (OPT-2, OPT-3): ``members`` is always a prefix of the scheduler's
``running`` list, in the same order, and is exactly the batch of the last
decode step (and of the next one, unless sequences join, finish or are
preempted). ``now`` counts the decode steps the group has run; a member that
joined at clock ``core.since`` with ``core.ntok`` tokens holds ``ntok + now - since``
tokens. ``positions[j] + now - base_clock`` is the arena index where member j's
next token goes (the step writes through a view of the arena shifted by
``now - base_clock`` instead of adding 1 to every position).
Nothing about a member is written per step. Every member advances one token
per step, so ``length - clock`` is fixed for a member: its *phase*, taken mod
block_size. ``phases[r]`` lists the members of phase r, in member order, so the
members whose length at clock c is ``1 mod block_size`` (they need a fresh
block before running: the reference's ``may_append``, ``needs_new_block``) are
``phases[(1 - c) % block_size]``, and those whose length is ``0 mod
block_size`` (their last block fills in postprocess: ``hash_blocks``) are
``phases[-c % block_size]``. ``finishes[c]`` lists, in member order, the
members whose completion count reaches max_tokens at clock c. A member leaving
(``settle``) is taken out of its phase and its finish entry. Members are
ordered by the ``core.gord`` they got on joining, which is their order in ``running``.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from optimized.core.sequence import Sequence

I64 = npt.NDArray[np.int64]


class DecodeGroup:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.now = 0
        self.inflight = False  # the members' batch was scheduled and awaits postprocess
        self.members: list[Sequence] = []
        self.positions: I64 = np.empty(0, dtype=np.int64)
        self.base_clock = 0
        self.phases: list[list[Sequence]] = [[] for _ in range(block_size)]
        self.tables: list[list[list[int]]] = [[] for _ in range(block_size)]
        self.finishes: dict[int, list[Sequence]] = {}
        self.eos_watchers = 0  # members with ignore_eos False
        self.stop_ids: dict[int, int] = {}  # stop token id -> members watching for it (OPT-24)
        self._next_gord = 0

    # --- clock arithmetic ----------------------------------------------------------------------
    def phase(self, seq: Sequence) -> int:
        """``(length - clock) mod block_size``, fixed while the sequence is a member."""
        return (seq.core.ntok - seq.core.since) % self.block_size

    def needing_blocks(self, clock: int) -> int:
        """The phase of the members whose length at ``clock`` is 1 mod block_size.

        Vectorises ``block_math.needs_new_block``: it is true for exactly the members of this phase.
        """
        return (1 - clock) % self.block_size

    def filling(self, clock: int) -> list[Sequence]:
        """Members whose length at ``clock`` is 0 mod block_size: postprocess fills their last block."""
        return self.phases[-clock % self.block_size]

    def _finish_step(self, seq: Sequence) -> int:
        """The clock whose postprocess brings the completion count to ``max_tokens``."""
        core = seq.core
        return core.since + core.max_tokens - 1 - (core.ntok - seq.num_prompt_tokens)

    # --- joining and leaving -------------------------------------------------------------------
    def join(self, seqs: list[Sequence], keep_segments: bool) -> None:
        """Running sequences that have finished their prefill enter the batch at the current clock.

        ``keep_segments``: a logged decode fill may still need a member's earlier segments.
        """
        now, phases, tables, finishes = self.now, self.phases, self.tables, self.finishes
        for seq in seqs:
            core = seq.core
            core.group = self
            core.since = now
            core.gord = self._next_gord
            self._next_gord += 1
            core.is_prefill = False
            if not keep_segments:
                core.segments.clear()
            # From this clock on, its length at clock c is anchor + c and its blocks are in this table list.
            core.segments.append((now, core.ntok - now, seq.block_table))
            phase = self.phase(seq)
            phases[phase].append(seq)
            tables[phase].append(seq.block_table)
            step = self._finish_step(seq)
            entry = finishes.get(step)
            if entry is None:
                finishes[step] = [seq]
            else:
                entry.append(seq)
            if not seq.ignore_eos:
                self.eos_watchers += 1
            if core.stops:
                self._watch(core.stops, 1)
        self.members.extend(seqs)
        fresh = np.fromiter((s.core.region_offset + s.core.ntok for s in seqs), dtype=np.int64, count=len(seqs))
        self.positions = np.concatenate((self.positions + (now - self.base_clock), fresh))
        self.base_clock = now

    def _watch(self, stops: frozenset[int], delta: int) -> None:
        """A member watching for ``stops`` joins (+1) or leaves (-1)."""
        watched = self.stop_ids
        for t in stops:
            count = watched.get(t, 0) + delta
            if count:
                watched[t] = count
            else:
                del watched[t]

    def _unbook_finish(self, seq: Sequence) -> None:
        step = self._finish_step(seq)
        entry = self.finishes.get(step)
        if entry is None:  # postprocess took this step's entry: the member is finishing by length now
            return
        entry.remove(seq)  # every other member is booked once (max_tokens never changes)
        if not entry:
            del self.finishes[step]

    def settle(self, seq: Sequence) -> None:
        """Write the member's clock-derived values into its fields and forget its bookings.

        The caller removes it from ``members`` (``truncate`` or ``remove_at``).
        """
        phase = self.phase(seq)
        members = self.phases[phase]
        j = members.index(seq)
        del members[j]
        del self.tables[phase][j]
        self._unbook_finish(seq)
        core = seq.core
        core.ntok += self.now - core.since
        core.ncached = core.ntok - 1
        core.nsched = int(self.inflight)
        core.is_prefill = False
        core.group = None
        if not seq.ignore_eos:
            self.eos_watchers -= 1
        if core.stops:
            self._watch(core.stops, -1)

    def dissolve(self) -> None:
        """Every member leaves (a decode step postprocessed off the fast path, given a copy of its batch)."""
        for seq in self.members:
            self.settle(seq)
        self.members.clear()
        self.positions = np.empty(0, dtype=np.int64)
        self.base_clock = self.now
        self.inflight = False

    def truncate(self, length: int) -> None:
        del self.members[length:]
        self.positions = self.positions[:length]

    def remove_at(self, indices: list[int]) -> None:
        """Drop members at these (ascending) indices."""
        members = self.members
        for j in reversed(indices):
            del members[j]
        positions = self.positions
        n = positions.shape[0]
        if len(indices) == 1:  # close the gap in place: one memmove, no new array
            j = indices[0]
            positions[j : n - 1] = positions[j + 1 :]
            self.positions = positions[: n - 1]
        else:
            keep = np.ones(n, dtype=bool)
            keep[indices] = False
            self.positions = positions[keep]

    def refresh_positions(self) -> None:
        """Recompute the arena positions after the arena moved regions."""
        members = self.members
        self.positions = np.fromiter(
            (s.core.region_offset + s.num_tokens for s in members), dtype=np.int64, count=len(members)
        )
        self.base_clock = self.now
