"""The Triton attention backend: the KV store, paged prefill and flash-decoding kernels behind AttentionBackend.

Invariants: each method is the Triton twin of the TorchBackend method of the same name (spec/kernels.md KERN-1..5);
it runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (how the tests drive it). Decode launches depend only on
tensor shapes, never on tensor values, so they can be captured in a CUDA graph (``capturable``); decode reads each
key through the block table, never an entry past a row's context (``reads_cache_in_place``), so it needs no plan.
"""

from __future__ import annotations

import torch

from kernels import triton_decode, triton_prefill, triton_store


class TritonBackend:
    name = "triton"
    capturable = True
    reads_cache_in_place = True
    needs_decode_plan = False

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        triton_store.store_kv(k, v, k_cache, v_cache, slot_mapping)

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
        return triton_prefill.paged_prefill(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)

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
        return triton_decode.paged_decode(q, k_cache, v_cache, context_lens, block_tables, scale)
