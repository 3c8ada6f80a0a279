"""The decode batch kept from step to step, advanced by a clock instead of per-sequence writes.

Invariants (OPT-2, OPT-3): ``members`` is always a prefix of the scheduler's
``running`` list, in the same order, and is exactly the batch of the last
decode step (and of the next one, unless sequences join, finish or are
preempted). ``now`` counts the decode steps the group has run; a member that
joined at clock ``_since`` with ``_ntok`` tokens holds ``_ntok + now - _since``
tokens. ``positions[j]`` is the arena index where member j's next token goes.
Nothing about a member is written per step; what changes at a known step is
booked on a calendar keyed by clock, in member order:

* ``allocs[c]``: members whose length at step c is ``1 mod block_size`` (they
  need a fresh block before running, the reference's ``may_append``);
* ``fills[c]``: members whose length at step c is ``0 mod block_size`` (the
  block holding their last token becomes full in postprocess: ``hash_blocks``);
* ``finishes[c]``: members whose completion count reaches max_tokens at step c.

Each member has exactly one entry of each kind at its next such step; an entry
is removed when the member leaves (``settle``). Members are ordered by the
``_gord`` they got on joining, which is their order in ``running``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from optimized.sequence import Sequence

I64 = npt.NDArray[np.int64]
Calendar = dict[int, list[Sequence]]


def _book(calendar: Calendar, clock: int, seq: Sequence) -> None:
    entry = calendar.get(clock)
    if entry is None:
        calendar[clock] = [seq]
    else:
        entry.append(seq)


def _unbook(calendar: Calendar, clock: int, seq: Sequence) -> None:
    entry = calendar.get(clock)
    if entry is not None and seq in entry:
        entry.remove(seq)
        if not entry:
            del calendar[clock]


class DecodeGroup:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.now = 0
        self.inflight = False  # the members' batch was scheduled and awaits postprocess
        self.members: list[Sequence] = []
        self.positions: I64 = np.empty(0, dtype=np.int64)
        self.allocs: Calendar = {}
        self.fills: Calendar = {}
        self.finishes: Calendar = {}
        self.eos_watchers = 0  # members with ignore_eos False
        self._next_gord = 0

    # --- clock arithmetic ----------------------------------------------------------------------
    def _next_step(self, seq: Sequence, start: int, residue: int) -> int:
        """The first clock >= start at which the member's length is ``residue`` mod block_size."""
        return start + (residue - (seq._ntok + start - seq._since)) % self.block_size

    def _finish_step(self, seq: Sequence, max_tokens: int) -> int:
        """The clock whose postprocess brings the completion count to ``max_tokens``."""
        return seq._since + max_tokens - 1 - (seq._ntok - seq.num_prompt_tokens)

    # --- joining and leaving -------------------------------------------------------------------
    def join(self, seqs: list[Sequence]) -> None:
        """Running sequences that have finished their prefill enter the batch at the current clock."""
        now = self.now
        for seq in seqs:
            seq._group = self
            seq._since = now
            seq._gord = self._next_gord
            self._next_gord += 1
            seq._is_prefill = False
            _book(self.allocs, self._next_step(seq, now, 1), seq)
            _book(self.fills, self._next_step(seq, now, 0), seq)
            _book(self.finishes, self._finish_step(seq, seq._max_tokens), seq)
            if not seq.ignore_eos:
                self.eos_watchers += 1
        self.members.extend(seqs)
        fresh = np.fromiter((s.region_offset + s._ntok for s in seqs), dtype=np.int64, count=len(seqs))
        self.positions = np.concatenate((self.positions, fresh))

    def settle(self, seq: Sequence) -> None:
        """Write the member's clock-derived values into its fields and forget its calendar entries.

        The caller removes it from ``members`` (``truncate`` or ``remove_at``).
        """
        now = self.now
        for calendar, clock in (
            (self.allocs, self._next_step(seq, now, 1)),
            (self.fills, self._next_step(seq, now, 0)),
            (self.finishes, self._finish_step(seq, seq._max_tokens)),
        ):
            _unbook(calendar, clock, seq)
        seq._ntok += now - seq._since
        seq._ncached = seq._ntok - 1
        seq._nsched = int(self.inflight)
        seq._is_prefill = False
        seq._group = None
        if not seq.ignore_eos:
            self.eos_watchers -= 1

    def dissolve(self) -> None:
        """Every member leaves (used when the caller departs from schedule/postprocess pairs)."""
        for seq in self.members:
            self.settle(seq)
        self.members.clear()
        self.positions = np.empty(0, dtype=np.int64)
        self.allocs.clear()
        self.fills.clear()
        self.finishes.clear()
        self.inflight = False

    def truncate(self, length: int) -> None:
        del self.members[length:]
        self.positions = self.positions[:length]

    def remove_at(self, indices: list[int]) -> None:
        """Drop members at these (ascending) indices."""
        for j in reversed(indices):
            del self.members[j]
        positions = self.positions
        if len(indices) == 1:
            j = indices[0]
            self.positions = np.concatenate((positions[:j], positions[j + 1 :]))
        else:
            keep = np.ones(positions.shape[0], dtype=bool)
            keep[indices] = False
            self.positions = positions[keep]

    def refresh_positions(self) -> None:
        """Recompute the arena positions after the arena moved regions."""
        members = self.members
        self.positions = np.fromiter(
            (s.region_offset + s.num_tokens for s in members), dtype=np.int64, count=len(members)
        )

    # --- what is due --------------------------------------------------------------------------
    def rebook(self, calendar: Calendar, clock: int, seqs: Iterable[Sequence]) -> None:
        """The members handled at ``clock`` are due again one block later (still in member order)."""
        later = clock + self.block_size
        entry = calendar.get(later)
        # Entries already there were booked by members that joined after clock - block_size + 1,
        # so they come later in member order than every sequence rebooked here.
        calendar[later] = list(seqs) if entry is None else [*seqs, *entry]

    def move_finish(self, seq: Sequence, max_tokens: int) -> None:
        """A member's max_tokens changed: its finish step moves with it."""
        _unbook(self.finishes, self._finish_step(seq, seq._max_tokens), seq)
        seq._max_tokens = max_tokens
        step = self._finish_step(seq, max_tokens)
        if step >= self.now:
            entry = self.finishes.setdefault(step, [])
            entry.append(seq)
            entry.sort(key=_gord)


def _gord(seq: Sequence) -> int:
    return seq._gord
