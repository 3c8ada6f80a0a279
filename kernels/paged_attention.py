"""Paged KV-cache store and attention, torch implementations (the oracle for the Triton kernels).

Invariants: the cache is ``[num_blocks, block_size, kvh, d]`` and contiguous, so slot ``s`` is row ``s`` of its
``[num_blocks * block_size, kvh, d]`` view, i.e. block ``s // block_size``, offset ``s % block_size``; slot -1 writes
nothing. Sequence b's context is the first ``context_lens[b]`` slots named by its block-table row (entries past the
context are -1 and never read). Its queries are the LAST ``qlen_b`` positions of that context, and query i may see key
j iff ``j <= context_lens[b] - qlen_b + i`` (causal). Attention arithmetic follows transformers' eager path: scores
``(q @ k^T) * scale`` in the input dtype, softmax in float32 cast back to the input dtype, then ``weights @ v`` —
GQA in prefill by repeating each KV head ``h // kvh`` times (as transformers' ``repeat_kv``), in decode by batching
each KV head's group of query heads against that head's keys, a view, never a copy. Decode reads the whole table
width it is given (the caller trims the table to the batch's widest context) and masks scores, never values, so
the cache must hold finite values in unused slots (it is zero-initialised and written only with K/V). A decode row
with context length 0 yields zeros, not NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _flat(cache: torch.Tensor) -> torch.Tensor:
    assert cache.is_contiguous(), "KV cache must be contiguous so a slot is one row of its flat view"
    return cache.view(-1, cache.shape[2], cache.shape[3])


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write row i of k/v to slot ``slot_mapping[i]``; slot -1 writes nothing (KERN-1)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    _flat(k_cache)[slots] = k[valid].to(k_cache.dtype)
    _flat(v_cache)[slots] = v[valid].to(v_cache.dtype)


def _gather(cache: torch.Tensor, table_row: torch.Tensor, n: int) -> torch.Tensor:
    block_size = cache.shape[1]
    num_blocks = (n + block_size - 1) // block_size
    blocks = table_row[:num_blocks].long()
    return cache[blocks].reshape(num_blocks * block_size, cache.shape[2], cache.shape[3])[:n]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of q[qlen,h,d] (the last qlen positions) over k, v [n,kvh,d]."""
    qlen, heads, _ = q.shape
    n, kv_heads, _ = k.shape
    rep = heads // kv_heads
    qh = q.transpose(0, 1)
    kh = k.transpose(0, 1).repeat_interleave(rep, dim=0)
    vh = v.transpose(0, 1).repeat_interleave(rep, dim=0)
    scores = torch.matmul(qh, kh.transpose(1, 2)) * scale
    q_pos = torch.arange(n - qlen, n, device=q.device)
    k_pos = torch.arange(n, device=q.device)
    future = k_pos[None, :] > q_pos[:, None]
    scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, vh).transpose(0, 1)


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed queries ``q[N,h,d]`` over each sequence's paged context (KERN-2, KERN-3)."""
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for b in range(len(lens)):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        n = lens[b]
        assert n >= end - start, "a sequence cannot have more queries than context tokens"
        k = _gather(k_cache, block_tables[b], n).to(q.dtype)
        v = _gather(v_cache, block_tables[b], n).to(q.dtype)
        out[start:end] = _attend(q[start:end], k, v, scale)
    return out


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence over its whole paged context, without host syncs (KERN-4).

    The blocks of the whole table width are gathered once (-1 entries clamped to block 0), so the cost follows the
    batch's widest context, which the caller sets by the table width it passes. GQA groups each KV head's
    ``h // kvh`` query heads into one batched product against that head's keys (a strided view, never repeated).
    Positions at or past the context length get the float32 minimum before the softmax (weight exactly 0, so no
    value of an unused slot reaches the output, the cache holding finite values) and their weights are zeroed after
    it, so a row with context length 0 — all masked, uniform before the zeroing — outputs zeros, not NaN.
    """
    r = decode_range(0, q.shape[0], context_lens, block_tables, k_cache.shape[1], empty_rows=True)
    return _decode_range(q, _gather_kv(k_cache, v_cache, r.blocks), r, scale)


@dataclass(frozen=True)
class DecodeRange:
    """Rows ``start:end`` of a decode batch, the flat block ids they gather (``rows * columns``, -1 clamped to 0)
    and the score mask (True past each row's context). Built once per step, used by every layer."""

    start: int
    end: int
    blocks: torch.Tensor  # int64 [rows * columns]
    masked: torch.Tensor  # bool [rows, 1, 1, columns * block_size]
    empty_rows: bool  # some row may have context 0 (its weights are zeroed after the softmax)


def decode_range(
    start: int, end: int, context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int, empty_rows: bool
) -> DecodeRange:
    """The range of rows ``start:end`` whose contexts fit ``block_tables``' width (KERN-20, KERN-21)."""
    rows, columns = block_tables.shape
    width = columns * block_size
    masked = torch.arange(width, device=block_tables.device) >= context_lens[:, None]
    blocks = block_tables.long().clamp(min=0).flatten()
    return DecodeRange(start, end, blocks, masked.view(rows, 1, 1, width), empty_rows)


def _kv_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor | None:
    """A contiguous ``[2, num_blocks, ...]`` view of both caches when v directly follows k in one allocation (the
    engine's layout), so that one gather fetches both; None otherwise."""
    same = k_cache.untyped_storage().data_ptr() == v_cache.untyped_storage().data_ptr()
    if not same or v_cache.storage_offset() != k_cache.storage_offset() + k_cache.numel():
        return None
    if k_cache.dtype != v_cache.dtype or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    return k_cache.as_strided((2, *k_cache.shape), (k_cache.numel(), *k_cache.stride()), k_cache.storage_offset())


def _gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Blocks are gathered as flat rows: torch's index_select of a 5-d tensor along dim 1 takes an element-wise path
    # about 8x slower than the row copies it makes of the same data viewed as [2, num_blocks, row] (measured).
    token = k_cache.shape[2:]  # [kvh, d]: the gathered caches are returned as [blocks * block_size, kvh, d]
    pair = _kv_pair(k_cache, v_cache)
    if pair is None:
        k, v = k_cache.flatten(1).index_select(0, blocks), v_cache.flatten(1).index_select(0, blocks)
        return k.view(-1, *token), v.view(-1, *token)
    both = pair.flatten(2).index_select(1, blocks)
    return both[0].view(-1, *token), both[1].view(-1, *token)


def _decode_range(q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], r: DecodeRange, scale: float) -> torch.Tensor:
    batch, heads, dim = q.shape
    kv_heads = kv[0].shape[1]
    rep = heads // kv_heads
    width = r.masked.shape[-1]
    k = kv[0].view(batch, width, kv_heads, dim)
    v = kv[1].view(batch, width, kv_heads, dim)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    groups = [slice(j * rep, (j + 1) * rep) for j in range(kv_heads)]
    # [B, kvh, rep, width]: query heads of group j against KV head j.
    scores = torch.stack([torch.bmm(q[:, g], k[:, :, j].transpose(1, 2)) for j, g in enumerate(groups)], 1) * scale
    # Masking in float32 (not the input dtype) keeps the fill finite, so an all-masked row is uniform, not NaN.
    scores32 = scores.to(torch.float32).masked_fill_(r.masked, torch.finfo(torch.float32).min)
    weights = torch.softmax(scores32, dim=-1).to(q.dtype)
    if r.empty_rows:
        # A row with some context gives its masked positions exp(min - max) = 0 already; only an all-masked row
        # (context 0) needs the zeroing.
        weights.masked_fill_(r.masked, 0)
    return torch.cat([torch.bmm(weights[:, j], v[:, :, j]) for j in range(kv_heads)], 1)


def paged_decode_ranges(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ranges: tuple[DecodeRange, ...], scale: float
) -> torch.Tensor:
    """``paged_decode`` of each range of rows, concatenated: bit for bit the same as calling ``paged_decode`` on each
    range with its trimmed table (KERN-21), with the masks and block ids made once per step and K and V fetched by
    one gather when the caches share an allocation."""
    parts = [_decode_range(q[r.start : r.end], _gather_kv(k_cache, v_cache, r.blocks), r, scale) for r in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts)
