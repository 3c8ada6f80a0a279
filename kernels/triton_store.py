# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Triton KV-cache store: one program per token row, masked so slot -1 writes nothing.

Invariants: equal to kernels.paged_attention.store_kv bit for bit (a copy with a cast to the cache dtype); the cache
is contiguous so slot s starts at element ``s * kvh * d``; k and v rows are read through their strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_stride_n,
    k_stride_h,
    v_stride_n,
    v_stride_h,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    inside = (heads < HEADS) & (dims < DIM)
    dst = slot * (HEADS * DIM) + heads * DIM + dims
    # dst < 0 exactly when slot < 0, since heads * DIM + dims < HEADS * DIM: a per-element form of "slot >= 0".
    write = inside & (dst >= 0)
    k = tl.load(k_ptr + row * k_stride_n + heads * k_stride_h + dims, mask=inside)
    v = tl.load(v_ptr + row * v_stride_n + heads * v_stride_h + dims, mask=inside)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=write)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=write)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton twin of kernels.paged_attention.store_kv (KERN-1)."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    rows, heads, dim = k.shape
    if rows == 0:
        return
    _store_kv_kernel[(rows,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        HEADS=heads,
        DIM=dim,
        BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(dim),
    )
