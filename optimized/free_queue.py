"""The free-block queue: FIFO order, O(1) removal from anywhere, many ids taken or added per numpy call.

Invariants: the queue's ids are the entries ``buf[i]`` with ``head <= i < tail``
and ``slot[buf[i]] == i``, read front to back; ``slot[b]`` is -1 exactly when
block b is not free; ``count`` is the number of free ids; ``stale`` is the
number of entries in ``[head, tail)`` whose block was removed from the middle
(``slot`` no longer points at them), so a front window of ``m + stale``
entries always holds the next m ids. It starts as 0, 1, ..., num_blocks-1, like
the reference's deque, and keeps the deque's order (OPT-4): ``take`` returns
the front ids, ``extend`` adds at the back, ``remove`` drops one id where it
stands (the reference's ``deque.remove`` without its scan; the entry is left
behind, stale, and skipped when the front reaches it).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]


class FreeBlockQueue:
    def __init__(self, num_blocks: int) -> None:
        self._buf: I64 = np.arange(2 * num_blocks + 16, dtype=np.int64)
        self._slot: I64 = np.arange(num_blocks, dtype=np.int64)
        self._head = 0
        self._tail = num_blocks
        self.count = num_blocks
        self.stale = 0

    def __len__(self) -> int:
        return self.count

    def contains(self, block_id: int) -> bool:
        return bool(self._slot[block_id] >= 0)

    def take(self, m: int) -> I64:
        """The m ids at the front, removed from the queue (m <= count)."""
        assert 0 <= m <= self.count, f"take {m} from a free queue of {self.count}"
        head = self._head
        if self.stale == 0:
            ids = self._buf[head : head + m].copy()
            self._head = head + m
        else:
            window = self._buf[head : head + m + self.stale]
            live = np.flatnonzero(self._slot[window] == np.arange(head, head + window.shape[0]))[:m]
            ids = window[live]
            consumed = int(live[-1]) + 1 if m else 0
            self.stale -= consumed - m
            self._head = head + consumed
        self._slot[ids] = -1
        self.count -= m
        return ids

    def popleft(self) -> int:
        return int(self.take(1)[0])

    def remove(self, block_id: int) -> None:
        assert self._slot[block_id] >= 0, f"block {block_id} is not free"
        self._slot[block_id] = -1
        self.count -= 1
        self.stale += 1

    def extend(self, ids: I64) -> None:
        """Append ids at the back, in order."""
        k = ids.shape[0]
        if self._tail + k > self._buf.shape[0]:
            self._compact(k)
        tail = self._tail
        self._buf[tail : tail + k] = ids
        self._slot[ids] = np.arange(tail, tail + k)
        self._tail = tail + k
        self.count += k

    def append(self, block_id: int) -> None:
        self.extend(np.array([block_id], dtype=np.int64))

    def _compact(self, extra: int) -> None:
        """Move the live entries to the start of a buffer with room for ``extra`` more."""
        live = self.ids()
        size = max(self._buf.shape[0], 2 * (live.shape[0] + extra))
        self._buf = np.empty(size, dtype=np.int64)
        self._buf[: live.shape[0]] = live
        self._slot[live] = np.arange(live.shape[0])
        self._head, self._tail, self.stale = 0, live.shape[0], 0

    def ids(self) -> I64:
        """The free ids, front to back."""
        window = self._buf[self._head : self._tail]
        live: I64 = window[self._slot[window] == np.arange(self._head, self._tail)]
        return live

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids().tolist())
