"""The free queue: the reference deque's order on an array (OPT-6)."""


from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st

from optimized.core.free_queue import FreeBlockQueue


@pytest.mark.clause("OPT-6")
@given(st.lists(st.tuples(st.sampled_from(["take", "release", "revive"]), st.integers(0, 7)), max_size=60))
def test_the_free_queue_keeps_the_reference_deque_order(ops: list[tuple[str, int]]) -> None:
    """OPT-6: takes from the front, releases at the back, revivals from anywhere: the deque's order."""
    model: deque[int] = deque(range(8))
    queue = FreeBlockQueue(8)
    for op, n in ops:
        if op == "take":
            m = min(n, len(model))
            assert queue.take(m) == [model.popleft() for _ in range(m)]
        elif op == "release" and n not in model:
            model.append(n)
            queue.append(n)
        elif op == "revive" and n in model:
            model.remove(n)
            queue.remove(n)
        assert list(queue) == list(model)
        assert len(queue) == len(model)
        assert all(queue.contains(b) == (b in model) for b in range(8))
