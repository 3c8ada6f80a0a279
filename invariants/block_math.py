"""The integer arithmetic the scheduler and the model runner stand on, with contracts.

Each function is small, pure, and carries PEP 316 contracts (``pre:``/``post:``
in its docstring) that ``crosshair check invariants/block_math.py`` verifies
symbolically in CI (spec/contracts.md). The postconditions restate each rule in
a second, independent way (token capacity instead of block counts, per-token
slots instead of per-block runs), so a wrong formula contradicts its contract.
``batch_slot_mapping`` is the runner's numpy form; crosshair cannot execute
numpy symbolically, so a hypothesis test holds it equal to ``chunk_slot_runs``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens.

    pre: num_tokens >= 0
    pre: block_size >= 1
    post: __return__ * block_size >= num_tokens
    post: __return__ == 0 or (__return__ - 1) * block_size < num_tokens
    """
    return (num_tokens + block_size - 1) // block_size


def needs_new_block(seq_len: int, block_size: int) -> bool:
    """Whether the token at index ``seq_len - 1`` (just appended) opens a new block.

    The lesson's test ``len % block_size == 1``; it needs block_size >= 2 (EDGE-1).

    pre: seq_len >= 1
    pre: block_size >= 2
    post: __return__ == (blocks_for(seq_len, block_size) > blocks_for(seq_len - 1, block_size))
    """
    return seq_len % block_size == 1


def admits(prompt_len: int, max_tokens: int, block_size: int, num_blocks: int) -> bool:
    """The admission rule: the request can finish in the cache even when alone in it.

    A sequence's KV holds at most prompt_len + max_tokens - 1 tokens: the last
    sampled token finishes the request and is never fed back.

    pre: prompt_len >= 1
    pre: max_tokens >= 1
    pre: block_size >= 1
    pre: num_blocks >= 1
    post: __return__ == (prompt_len + max_tokens - 1 <= num_blocks * block_size)
    """
    return blocks_for(prompt_len + max_tokens - 1, block_size) <= num_blocks


def prefill_grant(num_tokens: int, remaining: int, is_first: bool) -> int:
    """Tokens the prefill loop grants a sequence; 0 means the loop stops here.

    Only the first sequence of a batch may be chunked (lesson §3).

    pre: num_tokens >= 1
    pre: remaining >= 1
    post: 0 <= __return__ <= min(num_tokens, remaining)
    post: __return__ >= 1 if is_first else __return__ in (0, num_tokens)
    post: __return__ == num_tokens or __return__ == 0 or (is_first and __return__ == remaining)
    """
    if remaining < num_tokens and not is_first:
        return 0
    return min(num_tokens, remaining)


def slot_of(position: int, block_table: Sequence[int], block_size: int) -> int:
    """The cache slot of token ``position`` through its block table.

    pre: block_size >= 1
    pre: 0 <= position < len(block_table) * block_size
    pre: all(b >= 0 for b in block_table)
    post: __return__ // block_size == block_table[position // block_size]
    post: __return__ % block_size == position % block_size
    """
    return block_table[position // block_size] * block_size + position % block_size


def per_token_slots(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """The definition: ``slot_of`` of each position in [start, end)."""
    return [slot_of(p, block_table, block_size) for p in range(start, end)]


def expand_runs(runs: Sequence[tuple[int, int]]) -> list[int]:
    """Runs (first slot, length) written out slot by slot."""
    return [first + k for first, length in runs for k in range(length)]


def chunk_slot_runs(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[tuple[int, int]]:
    """Slots of positions [start, end) as runs (first slot, length), one run per block touched.

    pre: block_size >= 1
    pre: 0 <= start <= end <= len(block_table) * block_size
    pre: all(b >= 0 for b in block_table)
    post: expand_runs(__return__) == per_token_slots(block_table, start, end, block_size)
    """
    runs: list[tuple[int, int]] = []
    position = start
    while position < end:
        block_end = min(end, (position // block_size + 1) * block_size)
        runs.append((slot_of(position, block_table, block_size), block_end - position))
        position = block_end
    return runs


def batch_slot_mapping(
    block_tables: npt.NDArray[np.int64], starts: npt.NDArray[np.int64], ends: npt.NDArray[np.int64], block_size: int
) -> npt.NDArray[np.int64]:
    """Slots of every row's positions [starts[i], ends[i]), concatenated in row order.

    ``block_tables`` is [rows, width], padded with -1; each row's positions must
    lie inside its real blocks. No per-token Python loop: one gather over all positions.
    """
    lengths = ends - starts
    total = int(lengths.sum())
    rows = np.repeat(np.arange(len(starts), dtype=np.int64), lengths)
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    positions = np.repeat(starts, lengths) + offsets
    blocks = np.asarray(block_tables[rows, positions // block_size], dtype=np.int64)
    slots: npt.NDArray[np.int64] = blocks * block_size + positions % block_size
    return slots
