"""Paged decode attention through the compiled C kernel (``cpu_attention.c``), reading the cache in place.

Invariants: ``paged_decode`` takes the torch ``paged_decode``'s arguments and computes the same attention (spec
KERN-22) for float32 and float64 tensors on the CPU whose caches are contiguous and whose query heads have unit
stride (``supports``); it never copies the cache, nor the query when its heads are strided views of a packed
projection. It runs on ``torch.get_num_threads()`` threads, so ``torch.set_num_threads`` governs it. Block tables
are checked by the kernel before it writes anything: a context that does not fit its table row, or names a block
outside the cache, is a ValueError naming the row, never an out-of-bounds read.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from kernels.cpu_build import load_library

_SYMBOLS = {torch.float32: "nv_paged_decode_f32", torch.float64: "nv_paged_decode_f64"}
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# q, q row stride, q head stride, k_cache, v_cache, num_blocks, block_size, context_lens, block_tables, width, out,
# batch, heads, kv_heads, head_dim, scale, threads.
_ARGTYPES = [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64]


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the compiled kernel can take these tensors (otherwise the torch decode must)."""
    return (
        q.dtype in _SYMBOLS
        and q.dtype == k_cache.dtype == v_cache.dtype
        and q.device.type == k_cache.device.type == v_cache.device.type == "cpu"
        and q.dim() == 3
        and q.stride(2) == 1
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


@functools.cache
def _decode_fn(dtype: torch.dtype) -> Callable[..., int]:
    fn = getattr(load_library(), _SYMBOLS[dtype])
    fn.argtypes = [*_ARGTYPES, ctypes.c_double, _I64]
    fn.restype = _I64
    call: Callable[..., int] = fn
    return call


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence (``q[B,h,d]``) over its paged context, read in place (KERN-22)."""
    if not supports(q, k_cache, v_cache):
        raise ValueError("the C decode takes float32/float64 CPU tensors, contiguous caches and unit-stride heads")
    batch, heads, dim = q.shape
    num_blocks, block_size, kv_heads, cache_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or cache_dim != dim or heads % kv_heads != 0:
        raise ValueError(f"caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    lens = context_lens.to(torch.int32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    if lens.shape != (batch,) or tables.dim() != 2 or tables.shape[0] != batch:
        raise ValueError(f"context_lens {tuple(lens.shape)} and block_tables {tuple(tables.shape)} need {batch} rows")
    out = torch.empty(batch, heads, dim, dtype=q.dtype)
    # Named for torch.profiler, which does not see into a ctypes call (nearly free when no profiler runs).
    with torch.profiler.record_function("nanoverify::cpu_paged_decode"):
        code = _decode_fn(q.dtype)(
            q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks, block_size,
            lens.data_ptr(), tables.data_ptr(), tables.shape[1], out.data_ptr(), batch, heads, kv_heads, dim,
            scale, torch.get_num_threads(),
        )  # fmt: skip
    if code > 0:
        row = code - 1
        raise ValueError(
            f"block_tables row {row}: context length {int(lens[row])} does not fit its {tables.shape[1]} columns of "
            f"{block_size} slots, or names a block outside [0, {num_blocks})"
        )
    if code < 0:
        raise MemoryError("the C decode could not allocate its score buffers")
    return out
