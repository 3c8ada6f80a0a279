"""The free-block queue: FIFO order, O(1) removal from anywhere, batched takes and appends.

Invariants: the queue's ids are the entries ``buf[k]`` with ``head <= k`` and
``slot[buf[k]] == base + k``, read front to back (``base`` counts entries
trimmed off the front, so ``slot`` never needs rewriting when the list is
trimmed); ``slot[b]`` is -1 exactly when block b is not free; ``count`` is the
number of free ids; ``stale`` is the number of entries at or after ``head``
whose block was removed from the middle, so skipping them is bounded. It
starts as 0, 1, ..., num_blocks-1, like the reference's deque, and keeps the
deque's order (OPT-4): ``take`` returns the front ids, ``extend`` adds at the
back, ``remove`` drops one id where it stands (the reference's
``deque.remove`` without its scan; the entry stays behind, stale, and is
skipped when the front reaches it). Plain lists, not numpy: most calls move a
handful of ids, where numpy's per-call overhead would dominate.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class FreeBlockQueue:
    def __init__(self, num_blocks: int) -> None:
        self._buf: list[int] = list(range(num_blocks))
        self._slot: list[int] = list(range(num_blocks))
        self._base = 0
        self._head = 0
        self.count = num_blocks
        self.stale = 0

    def __len__(self) -> int:
        return self.count

    def contains(self, block_id: int) -> bool:
        return self._slot[block_id] >= 0

    def take(self, m: int) -> list[int]:
        """The m ids at the front, removed from the queue (m <= count)."""
        assert 0 <= m <= self.count, f"take {m} from a free queue of {self.count}"
        buf, slot, head = self._buf, self._slot, self._head
        if self.stale == 0:
            ids = buf[head : head + m]
            head += m
        else:
            ids = []
            base = self._base
            while len(ids) < m:
                block_id = buf[head]
                if slot[block_id] == base + head:
                    ids.append(block_id)
                else:
                    self.stale -= 1
                head += 1
        for block_id in ids:
            slot[block_id] = -1
        self.count -= m
        if head > 1024 and 2 * head > len(buf):
            del buf[:head]  # one memmove; absolute positions (base + k) stay valid
            self._base += head
            head = 0
        self._head = head
        return ids

    def popleft(self) -> int:
        return self.take(1)[0]

    def remove(self, block_id: int) -> None:
        assert self._slot[block_id] >= 0, f"block {block_id} is not free"
        self._slot[block_id] = -1
        self.count -= 1
        self.stale += 1

    def extend(self, ids: Iterable[int]) -> None:
        """Append ids at the back, in order."""
        buf, slot = self._buf, self._slot
        start = self._base + len(buf)
        buf.extend(ids)  # ids may be any iterable: read them back from the list
        for position, block_id in enumerate(buf[start - self._base :], start):
            slot[block_id] = position
        self.count += len(buf) + self._base - start

    def append(self, block_id: int) -> None:
        self.extend((block_id,))

    def __iter__(self) -> Iterator[int]:
        buf, slot, base = self._buf, self._slot, self._base
        for k in range(self._head, len(buf)):
            if slot[buf[k]] == base + k:
                yield buf[k]
