"""flash-attn backend: paged prefill and decode through the ``flash_attn`` package, KV store through Triton.

Invariants: used only on CUDA when ``flash_attn`` imports (get_backend checks both). UNTESTED in this repository:
flash-attn is not installable on the CPU-only development machine, so nothing here has run; the Triton and torch
backends are the tested ones. flash-attn 2 requires the paged cache's block size to be a multiple of 256 (checked
here, a ValueError otherwise); its causal mask is aligned to the bottom-right corner, which is exactly "queries are
the last qlen positions of the context". Behaviour for a context length of 0 is flash-attn's, not KERN-4's. Its
decode reads the paged cache through the block table (``reads_cache_in_place``) and, with the Triton store, launches
without host syncs (``capturable``, as vLLM captures it); prefill reads lengths on the host, but is never captured.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from kernels import triton_store

FLASH_ATTN_BLOCK_MULTIPLE = 256


def _flash_attn() -> Any:
    return importlib.import_module("flash_attn")


def _check_block_size(k_cache: torch.Tensor) -> None:
    if k_cache.shape[1] % FLASH_ATTN_BLOCK_MULTIPLE != 0:
        raise ValueError(
            f"block_size must be a multiple of {FLASH_ATTN_BLOCK_MULTIPLE} for flash-attn, got {k_cache.shape[1]}"
        )


class FlashAttnBackend:
    name = "flash-attn"
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
        _check_block_size(k_cache)
        cu_seqlens_k = torch.zeros_like(cu_seqlens_q)
        cu_seqlens_k[1:] = torch.cumsum(context_lens, dim=0)
        max_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
        out: torch.Tensor = _flash_attn().flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_q,
            max_seqlen_k=int(context_lens.max().item()),
            softmax_scale=scale,
            causal=True,
            block_table=block_tables,
        )
        return out

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
        _check_block_size(k_cache)
        out: torch.Tensor = _flash_attn().flash_attn_with_kvcache(
            q.unsqueeze(1),
            k_cache,
            v_cache,
            cache_seqlens=context_lens,
            block_table=block_tables,
            softmax_scale=scale,
            causal=True,
        )
        return out.squeeze(1)
