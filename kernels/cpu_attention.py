"""Paged decode and prefill attention through the compiled C kernels (``cpu_attention.c``), reading the cache in place.

Invariants: ``paged_decode`` and ``paged_prefill`` take the torch implementations' arguments and compute the same
attention (spec KERN-22, KERN-27) for float32 and float64 tensors on the CPU whose caches are contiguous and whose query
heads have unit stride (``supports``); they never copy the cache (prefill copies each sequence's keys of one KV head
at a time, transposed, into a per-thread buffer), nor the queries when their heads are strided views of a packed
projection. Every tensor they hand to C is a CPU tensor (anything else is a ValueError naming it, since C would
read another device's pointer as host memory), and the output is allocated on ``q``'s device, never on torch's default
one. Tables, lengths and query offsets must hold integers that int32 holds: they are converted only then, never
truncated. They run on ``torch.get_num_threads()`` threads, so ``torch.set_num_threads`` governs them. The kernels check
block tables (and query counts) before they write anything: a context that does not fit its table row or names a block
outside the cache, or more queries than context, is a ValueError naming the row or sequence, never an out-of-bounds
read.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from kernels.cpu_build import load_library

_SUFFIXES = {torch.float32: "f32", torch.float64: "f64"}
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# Tables, lengths and query offsets: integer dtypes whose every value int32 holds (checked for int64).
_INDEX_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
_INT32 = torch.iinfo(torch.int32)
# Decode: q, q row stride, q head stride, k_cache, v_cache, num_blocks, block_size, context_lens, block_tables,
# width, out, batch, heads, kv_heads, head_dim, scale, threads. Prefill: cu_seqlens after block_size.
_ARGTYPES = {
    "decode": [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64],
    "prefill": [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64],
}


def refusal(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """Why the compiled kernel cannot take these tensors (the torch implementation must), naming the first one at
    fault; None when it can."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_cpu:
            return f"{name} is on {t.device}: the C kernels read CPU memory only"
        if t.dtype != q.dtype or t.dtype not in _SUFFIXES:
            return f"{name} is {t.dtype}: the C kernels take float32 or float64, the same for q and both caches"
    if q.dim() != 3 or q.stride(2) != 1:
        return f"q {tuple(q.shape)} (strides {q.stride()}) is not [rows, heads, head_dim] with unit-stride heads"
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous():
            return f"{name} is not contiguous: the C kernels index the cache in place"
    return None


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the compiled kernel can take these tensors (otherwise the torch implementation must)."""
    return refusal(q, k_cache, v_cache) is None


@functools.cache
def _kernel(kind: str, dtype: torch.dtype, library: ctypes.CDLL | None = None) -> Callable[..., int]:
    fn = getattr(load_library() if library is None else library, f"nv_paged_{kind}_{_SUFFIXES[dtype]}")
    fn.argtypes = [*_ARGTYPES[kind], ctypes.c_double, _I64]
    fn.restype = _I64
    call: Callable[..., int] = fn
    return call


def _shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    reason = refusal(q, k_cache, v_cache)
    if reason is not None:
        raise ValueError(reason)
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} is not [num_blocks, block_size, kv_heads, head_dim]")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} is not shaped as k_cache {tuple(k_cache.shape)}")
    heads, dim = q.shape[1:]
    kv_heads, cache_dim = k_cache.shape[2:]
    if kv_heads == 0:
        raise ValueError("k_cache has 0 KV heads")
    if cache_dim != dim:
        raise ValueError(f"k_cache head_dim {cache_dim} is not q's {dim}")
    if heads % kv_heads != 0:
        raise ValueError(f"q has {heads} heads, not a multiple of the caches' {kv_heads} KV heads")


def _int32(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` as the contiguous CPU int32 array the C kernels read, refused unless every value converts exactly
    (a cast alone would read block id 2**32 + 3 as block 3, past the kernels' table check)."""
    if not t.is_cpu:
        raise ValueError(f"{name} is on {t.device}: the C kernels read CPU memory only")
    if t.dtype == torch.int32 and t.is_contiguous():
        return t
    if t.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} is {t.dtype}: it must hold integers")
    if t.dtype == torch.int64 and t.numel() > 0:
        outside = (t < _INT32.min) | (t > _INT32.max)
        if bool(outside.any()):
            at = tuple(int(i) for i in outside.nonzero()[0]) if t.dim() > 0 else ()
            row = f" row {at[0]}" if at else ""
            raise ValueError(f"{name}{row} holds {int(t[at])}, outside int32, which the C kernels index with")
    return t.to(torch.int32).contiguous()


def _table_rows(tables: torch.Tensor, batch: int) -> None:
    if tables.dim() != 2 or tables.shape[0] != batch:
        raise ValueError(f"block_tables {tuple(tables.shape)} is not one row of block ids for each of {batch} rows")


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    library: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """One query per sequence (``q[B,h,d]``) over its paged context, read in place (KERN-22). ``library``: another
    build of ``cpu_attention.c`` (a test's), instead of this machine's."""
    _shapes(q, k_cache, v_cache)
    batch, heads, dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    lens, tables = _int32(context_lens, "context_lens"), _int32(block_tables, "block_tables")
    if lens.shape != (batch,):
        raise ValueError(f"context_lens {tuple(lens.shape)} is not one length for each of q's {batch} rows")
    _table_rows(tables, batch)
    out = torch.empty(batch, heads, dim, dtype=q.dtype, device=q.device)
    # Named for torch.profiler, which does not see into a ctypes call (nearly free when no profiler runs).
    with torch.profiler.record_function("nanoverify::cpu_paged_decode"):
        code = _kernel("decode", q.dtype, library)(
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


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    library: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """Causal attention of the packed queries ``q[N,h,d]`` over each sequence's paged context (KERN-27); ``library``
    as for ``paged_decode``."""
    _shapes(q, k_cache, v_cache)
    rows, heads, dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    cu = _int32(cu_seqlens_q, "cu_seqlens_q")
    lens, tables = _int32(context_lens, "context_lens"), _int32(block_tables, "block_tables")
    if lens.dim() != 1:
        raise ValueError(f"context_lens {tuple(lens.shape)} is not one length per sequence")
    batch = lens.shape[0]
    if cu.shape != (batch + 1,):
        raise ValueError(f"cu_seqlens_q {tuple(cu.shape)} is not the {batch + 1} offsets of {batch} sequences")
    _table_rows(tables, batch)
    if int(cu[-1]) != rows:
        raise ValueError(f"cu_seqlens_q ends at {int(cu[-1])}, but q has {rows} rows")
    out = torch.empty(rows, heads, dim, dtype=q.dtype, device=q.device)
    with torch.profiler.record_function("nanoverify::cpu_paged_prefill"):
        code = _kernel("prefill", q.dtype, library)(
            q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks, block_size,
            cu.data_ptr(), lens.data_ptr(), tables.data_ptr(), tables.shape[1], out.data_ptr(), batch, heads,
            kv_heads, dim, scale, torch.get_num_threads(),
        )  # fmt: skip
    if code > 0:
        seq = code - 1
        raise ValueError(
            f"sequence {seq}: {int(cu[seq + 1]) - int(cu[seq])} queries over a context of {int(lens[seq])} tokens, "
            f"or a context its {tables.shape[1]} table columns of {block_size} slots (blocks in [0, {num_blocks})) "
            "do not hold"
        )
    if code < 0:
        raise MemoryError("the C prefill could not allocate its buffers")
    return out
