"""The torch attention backend: the oracle's store, prefill and decode, and its per-step decode plan.

Invariants: results are those of ``kernels.paged_attention`` (KERN-1..KERN-5). Its decode gathers the blocks of the
whole table width it is given (KERN-20), so the engine sorts its decode rows by context length (it does not declare
``reads_cache_in_place``) and asks it for a plan each eager decode step (``needs_decode_plan``): contiguous row
ranges, each with a table trimmed to its own longest context, whose masks and block ids are made once per step
rather than in every layer (ENG-26, ENG-30, KERN-21). A plan is correct for rows in any order; sorted rows make its
ranges narrow. Its store synchronises with the host (a boolean mask), so it is not ``capturable`` (ENG-28).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import paged_attention
from kernels.paged_attention import DecodeRange

# A decode step splits its rows into at most this many ranges of at least MIN_SPLIT_ROWS rows: each range costs a
# few dozen small ops per layer, paid for by a narrower gather whose keys stay in cache for the products (measured
# at 256 length-sorted rows of 2..384 tokens: 1 range 67 ms, 4: 18 ms, 16: 7.7 ms, 64: 11.8 ms).
MAX_DECODE_SPLITS = 16
MIN_SPLIT_ROWS = 16


@dataclass(frozen=True)
class RangePlan:
    """The torch backend's decode plan for one step: its row ranges, in row order, covering the batch."""

    ranges: tuple[DecodeRange, ...]


def decode_splits(
    context_lens: Sequence[int], block_size: int, max_splits: int = MAX_DECODE_SPLITS, min_rows: int = MIN_SPLIT_ROWS
) -> tuple[tuple[int, int, int], ...]:
    """Row ranges ``(a, b, columns)`` covering the batch in order, each as wide as its longest row needs (at least
    one column): at most ``max_splits`` ranges, of at least ``min_rows`` rows unless there is only one."""
    batch = len(context_lens)
    num = max(1, min(max_splits, batch // min_rows))
    bounds = [batch * i // num for i in range(num + 1)]
    return tuple((a, b, max(1, -(-max(context_lens[a:b]) // block_size))) for a, b in itertools.pairwise(bounds))


class TorchBackend:
    """Reference paged attention in plain torch; runs anywhere, matches transformers' eager arithmetic."""

    name = "torch"
    capturable = False
    reads_cache_in_place = False
    needs_decode_plan = True

    def __init__(self, max_decode_splits: int = MAX_DECODE_SPLITS, min_split_rows: int = MIN_SPLIT_ROWS) -> None:
        self.max_decode_splits = max_decode_splits
        self.min_split_rows = min_split_rows

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        paged_attention.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return paged_attention.paged_prefill(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)

    def plan_decode(self, context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> RangePlan:
        """The step's row ranges with their masks and block ids (ENG-26, KERN-21)."""
        lens: list[int] = context_lens.tolist()
        splits = decode_splits(lens, block_size, self.max_decode_splits, self.min_split_rows)
        return RangePlan(
            tuple(
                paged_attention.decode_range(
                    a, b, context_lens[a:b], block_tables[a:b, :w], block_size, empty_rows=min(lens[a:b]) == 0
                )
                for a, b, w in splits
            )
        )

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
        plan: object | None = None,
    ) -> torch.Tensor:
        """KERN-4's decode; with this step's plan, ``paged_decode_ranges`` over its ranges (KERN-21)."""
        if plan is None:
            return paged_attention.paged_decode(q, k_cache, v_cache, context_lens, block_tables, scale)
        assert isinstance(plan, RangePlan), f"the torch backend's decode got a plan it did not make: {plan!r}"
        return paged_attention.paged_decode_ranges(q, k_cache, v_cache, plan.ranges, scale)
