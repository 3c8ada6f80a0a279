"""The free-block queue: FIFO order, O(1) removal from anywhere, takes that write nothing per block.

Invariants: entries live in ``buf``; the entry ``buf[k]`` sits at absolute
position ``base + k`` (``base`` counts entries trimmed off the front, so
positions never need rewriting). ``front`` is the absolute position of the
queue's front. ``slot[b]`` is the absolute position of block b's latest entry,
or -1 after ``remove``; block b is free exactly when ``slot[b] >= front``, so
taking blocks only moves ``front`` past them. An entry at position p is live
when ``slot[buf[p - base]] == p``; ``stale`` counts the dead entries at or after
``front`` (blocks removed from the middle), so skipping them is bounded.
``count`` is the number of free blocks. Entries from absolute position
``_unslotted`` to the end were appended by ``extend`` and their blocks' slots
are not written yet (most released blocks are taken again, or never asked
about, before anything reads a slot): every reader of ``slot`` first calls
``settle``, which writes them. It starts as 0, 1, ...,
num_blocks-1, like the reference's deque, and keeps the deque's order (OPT-6):
``take`` returns the front ids, ``extend`` adds at the back, ``remove`` drops
one id where it stands (the reference's ``deque.remove`` without its scan).
Plain lists, not numpy: most calls move a handful of ids, where numpy's
per-call overhead would dominate.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence


class FreeBlockQueue:
    def __init__(self, num_blocks: int) -> None:
        self._buf: list[int] = list(range(num_blocks))
        self._slot: list[int] = list(range(num_blocks))
        self._base = 0
        self._unslotted = num_blocks
        self.front = 0
        self.count = num_blocks
        self.stale = 0

    def __len__(self) -> int:
        return self.count

    def settle(self) -> None:
        """Write the slots of the entries ``extend`` appended since the last call."""
        buf, base = self._buf, self._base
        end = base + len(buf)
        if self._unslotted == end:
            return
        start = max(self._unslotted, self.front)  # entries already taken need no slot
        slot = self._slot
        position = start
        for block_id in buf[start - base :]:
            slot[block_id] = position
            position += 1
        self._unslotted = end

    def contains(self, block_id: int) -> bool:
        if self._unslotted != self._base + len(self._buf):
            self.settle()
        return self._slot[block_id] >= self.front

    def slots(self) -> list[int]:
        """The settled slot list, for callers that test many blocks (free iff ``slot[b] >= front``)."""
        self.settle()
        return self._slot

    def take(self, m: int) -> list[int]:
        """The m ids at the front, removed from the queue (m <= count)."""
        assert 0 <= m <= self.count, f"take {m} from a free queue of {self.count}"
        buf, base, front = self._buf, self._base, self.front
        k = front - base
        if self.stale == 0:
            ids = buf[k : k + m]
            k += m
        else:
            self.settle()
            slot = self._slot
            ids = []
            while len(ids) < m:
                block_id = buf[k]
                if slot[block_id] == base + k:
                    ids.append(block_id)
                else:
                    self.stale -= 1
                k += 1
        self.count -= m
        if k > 1024 and 2 * k > len(buf):
            del buf[:k]  # one memmove; absolute positions (base + k) stay valid
            base += k
            self._base = base
            self._unslotted = max(self._unslotted, base)
            k = 0
        self.front = base + k
        return ids

    def popleft(self) -> int:
        return self.take(1)[0]

    def remove(self, block_id: int) -> None:
        self.settle()
        assert self._slot[block_id] >= self.front, f"block {block_id} is not free"
        self._slot[block_id] = -1
        self.count -= 1
        self.stale += 1

    def extend(self, ids: Sequence[int]) -> None:
        """Append ids (distinct, none of them free) at the back, in order; their slots are written by ``settle``."""
        self._buf.extend(ids)
        self.count += len(ids)

    def append(self, block_id: int) -> None:
        self.extend((block_id,))

    def __iter__(self) -> Iterator[int]:
        self.settle()
        buf, slot, base = self._buf, self._slot, self._base
        for k in range(self.front - base, len(buf)):
            if slot[buf[k]] == base + k:
                yield buf[k]
