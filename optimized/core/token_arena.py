"""Token storage shared by every live sequence of one scheduler: one int64 array.

Invariants: each live sequence owns the region ``[off, off + capacity)`` of
``data``, where capacity is ``num_prompt_tokens + max_tokens`` (the longest it
can grow: it finishes when its completion count reaches max_tokens); regions
never overlap; ``top`` is the first index past every region; ``dead`` counts
the positions of released regions below ``top``. Because all tokens sit in one
array, the decode step appends one token to every sequence of a batch with a
single scatter ``data[positions] = tokens``. When a region is needed and the
array is full, the live regions are packed, in placement order, into a fresh
array at least twice their size (amortised O(1) per token; released regions are never
written again, so a released owner may keep a view of its tokens), and ``on_move``
is called so that the scheduler recomputes the positions it cached. Tokens are stored little-endian,
exactly the bytes the prefix-cache hash reads; ``bytes_view`` is those bytes, always over the current ``data``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]


class Region(Protocol):
    """What the arena needs to know of a region's owner to move it."""

    region_offset: int
    region_capacity: int

    def stored_length(self) -> int: ...


class TokenArena:
    def __init__(self, on_move: Callable[[], None], capacity: int = 1 << 16) -> None:
        self.data: I64 = np.empty(capacity, dtype="<i8")
        self.bytes_view = self.data.data.cast("B")  # the same memory as bytes: slices hash without a copy
        self.top = 0
        self.dead = 0
        self._owners: dict[int, Region] = {}
        self._on_move = on_move

    def place(self, owner: Region, tokens: I64, capacity: int) -> None:
        """Give ``owner`` a fresh region of ``capacity`` positions starting with ``tokens``."""
        if self.top + capacity > self.data.shape[0]:
            self._make_room(capacity)
            self._on_move()
        off = self.top
        self.data[off : off + tokens.shape[0]] = tokens
        self.top += capacity
        owner.region_offset = off
        owner.region_capacity = capacity
        self._owners[id(owner)] = owner

    def release(self, owner: Region) -> I64:
        """Free the owner's region and hand back its tokens.

        A view, not a copy: a released region is never written again (placement only moves ``top``
        up, and packing writes a fresh array), so the view stays valid; it keeps the array it
        points into alive after a packing, until the owner drops it.
        """
        del self._owners[id(owner)]
        off = owner.region_offset
        self.dead += owner.region_capacity
        return self.data[off : off + owner.stored_length()]

    def _make_room(self, capacity: int) -> None:
        live = self.top - self.dead
        size = self.data.shape[0]
        while size < 2 * (live + capacity):
            size *= 2
        fresh: I64 = np.empty(size, dtype="<i8")
        top = 0
        # Regions are packed in the order they were placed: relative order never changes.
        for owner in self._owners.values():
            off, n = owner.region_offset, owner.stored_length()
            fresh[top : top + n] = self.data[off : off + n]
            owner.region_offset = top
            top += owner.region_capacity
        self.data = fresh
        self.bytes_view = fresh.data.cast("B")
        self.top = top
        self.dead = 0
