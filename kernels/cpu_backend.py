"""The CPU attention backend: the torch KV store, and compiled C decode and prefill that read the cache in place.

Invariants: ``store_kv`` is the torch backend's (KERN-1); ``decode`` and ``prefill`` run the C kernels (KERN-22,
KERN-27) whenever they take the tensors (float32 or float64, contiguous caches) and the torch ones otherwise, so the
backend serves every dtype; made for the batch-invariant mode (``batch_invariant=True``) it never falls back: tensors
the C kernels cannot take are a ValueError with the reason, since torch's prefill and decode sum a query's keys in
different orders (spec/batch-invariance.md BI-4, BI-7). Its decode reads exactly each row's context whatever the
table width, so a caller gains nothing by sorting or splitting rows (``reads_cache_in_place``).
"""

from __future__ import annotations

import torch

from kernels import cpu_attention, paged_attention


class CpuBackend:
    name = "cpu"
    capturable = False  # CPU only: there are no CUDA graphs to capture it in
    reads_cache_in_place = True
    needs_decode_plan = False

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def _compiled(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Whether the C kernels take these tensors; in the batch-invariant mode they must."""
        reason = cpu_attention.refusal(q, k_cache, v_cache)
        if reason is not None and self.batch_invariant:
            raise ValueError(f"batch_invariant: the C attention cannot take these tensors ({reason}), and torch's "
                             "would change bits between prefill and decode (BI-4)")  # fmt: skip
        return reason is None

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
        if self._compiled(q, k_cache, v_cache):
            return cpu_attention.paged_prefill(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)
        return paged_attention.paged_prefill(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)

    def plan_decode(self, context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> None:
        """No per-step state: decode reads each row's context in place (never called: ``needs_decode_plan`` False)."""
        return None

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
        if self._compiled(q, k_cache, v_cache):
            return cpu_attention.paged_decode(q, k_cache, v_cache, context_lens, block_tables, scale)
        return paged_attention.paged_decode(q, k_cache, v_cache, context_lens, block_tables, scale)
