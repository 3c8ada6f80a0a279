"""The free-block queue: FIFO order with O(1) removal from anywhere.

Invariants: the queue is a doubly linked list threaded through two Python
lists indexed by block id, closed by one sentinel node (id ``num_blocks``);
``contains(b)`` is True exactly for the ids on the list; ``len`` is their count;
iteration yields them front to back. It starts as 0, 1, ..., num_blocks-1,
like the reference's deque, and every operation keeps the same order the deque
would: ``popleft`` takes the front, ``append`` adds at the back, ``remove``
unlinks one id in place (the reference's ``deque.remove``, without its scan).
"""

from __future__ import annotations

from collections.abc import Iterator


class FreeBlockQueue:
    def __init__(self, num_blocks: int) -> None:
        sentinel = num_blocks
        self._sentinel = sentinel
        # next[i] = i + 1 closes onto the sentinel at i = num_blocks - 1; the sentinel points at 0.
        self._next: list[int] = [*range(1, num_blocks + 1), 0 if num_blocks else sentinel]
        self._prev: list[int] = [sentinel, *range(num_blocks - 1), num_blocks - 1] if num_blocks else [sentinel]
        self._in = [True] * num_blocks
        self.count = num_blocks

    def __len__(self) -> int:
        return self.count

    def contains(self, block_id: int) -> bool:
        return self._in[block_id]

    def front(self) -> int:
        """The id ``popleft`` would take (the queue must not be empty)."""
        return self._next[self._sentinel]

    def popleft(self) -> int:
        block_id = self._next[self._sentinel]
        assert block_id != self._sentinel, "popleft from an empty free queue"
        self.remove(block_id)
        return block_id

    def remove(self, block_id: int) -> None:
        assert self._in[block_id], f"block {block_id} is not free"
        nxt, prv = self._next, self._prev
        before, after = prv[block_id], nxt[block_id]
        nxt[before] = after
        prv[after] = before
        self._in[block_id] = False
        self.count -= 1

    def append(self, block_id: int) -> None:
        assert not self._in[block_id], f"block {block_id} is already free"
        nxt, prv = self._next, self._prev
        tail = prv[self._sentinel]
        nxt[tail] = block_id
        prv[block_id] = tail
        nxt[block_id] = self._sentinel
        prv[self._sentinel] = block_id
        self._in[block_id] = True
        self.count += 1

    def __iter__(self) -> Iterator[int]:
        nxt, node = self._next, self._next[self._sentinel]
        while node != self._sentinel:
            yield node
            node = nxt[node]
