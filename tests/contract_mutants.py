"""Deliberately wrong variants of invariants/block_math.py, each under the real function's contract.

tests/test_contracts.py feeds each one to crosshair and expects a counterexample:
a contract that no wrong variant can violate proves nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from invariants.block_math import blocks_for, expand_runs, per_token_slots, slot_of  # noqa: F401 (the contracts name them)


def blocks_for_floor(num_tokens: int, block_size: int) -> int:
    """
    pre: num_tokens >= 0
    pre: block_size >= 1
    post: __return__ * block_size >= num_tokens
    post: __return__ == 0 or (__return__ - 1) * block_size < num_tokens
    """
    return num_tokens // block_size


def needs_new_block_off_by_one(seq_len: int, block_size: int) -> bool:
    """
    pre: seq_len >= 1
    pre: block_size >= 2
    post: __return__ == (blocks_for(seq_len, block_size) > blocks_for(seq_len - 1, block_size))
    """
    return seq_len % block_size == 0


def admits_forgets_last_token(prompt_len: int, max_tokens: int, block_size: int, num_blocks: int) -> bool:
    """
    pre: prompt_len >= 1
    pre: max_tokens >= 1
    pre: block_size >= 1
    pre: num_blocks >= 1
    post: __return__ == (prompt_len + max_tokens - 1 <= num_blocks * block_size)
    """
    return blocks_for(prompt_len + max_tokens, block_size) <= num_blocks


def prefill_grant_chunks_everyone(num_tokens: int, remaining: int, is_first: bool) -> int:
    """
    pre: num_tokens >= 1
    pre: remaining >= 1
    post: 0 <= __return__ <= min(num_tokens, remaining)
    post: __return__ >= 1 if is_first else __return__ in (0, num_tokens)
    post: __return__ == num_tokens or __return__ == 0 or (is_first and __return__ == remaining)
    """
    return min(num_tokens, remaining)


def slot_of_swapped(position: int, block_table: Sequence[int], block_size: int) -> int:
    """
    pre: block_size >= 1
    pre: 0 <= position < len(block_table) * block_size
    pre: all(b >= 0 for b in block_table)
    post: __return__ // block_size == block_table[position // block_size]
    post: __return__ % block_size == position % block_size
    """
    return block_table[position % len(block_table)] * block_size + position % block_size


def chunk_slot_runs_drops_tail(
    block_table: Sequence[int], start: int, end: int, block_size: int
) -> list[tuple[int, int]]:
    """
    pre: block_size >= 1
    pre: 0 <= start <= end <= len(block_table) * block_size
    pre: all(b >= 0 for b in block_table)
    post: expand_runs(__return__) == per_token_slots(block_table, start, end, block_size)
    """
    runs: list[tuple[int, int]] = []
    position = start
    while position < end:
        block_end = (position // block_size + 1) * block_size
        runs.append((slot_of(position, block_table, block_size), block_end - position))
        position = block_end
    return runs
