# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Triton paged decode attention (flash-decoding): one query per sequence, context split, then a reduce.

Invariants: program (b, head, split) covers context positions ``[split * T, min((split + 1) * T, ctx_b))`` with T
``tokens_per_split``, a constant of the call that nothing in the batch changes; it reads each key through the block
table (slot = table[b, j // block_size] * block_size + j % block_size) so any block size works, and keeps an online
softmax in float32 (running max, running sum, running weighted value) over tiles of BLOCK_N keys aligned to the
split's start. The reduce walks sequence b's own splits, ``ceil(ctx_b / T)`` of them, in index order: their global
max first, then the rescaled sums, one addition after another. So a row's bits depend on its query, its context and
T alone, never on the table's width (the batch's longest context) or on its batch mates (KERN-28). The grid has
``ceil(width / T)`` splits, a function of the table's shape, so the launch needs no host sync (CUDA-graph safe);
splits past a row's context compute nothing and are never read. A sequence with context 0 gets zeros.
Accumulation is float32 whatever the input dtype (fp16/bf16/fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NEG = -1.0e30
DEFAULT_TOKENS_PER_SPLIT = 256


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    lens_ptr,
    tables_ptr,
    acc_ptr,
    max_ptr,
    sum_ptr,
    scale,
    q_stride_b,
    q_stride_h,
    table_stride,
    num_heads,
    num_splits,
    BLOCK_SIZE: tl.constexpr,
    KV_HEADS: tl.constexpr,
    DIM: tl.constexpr,
    GROUP: tl.constexpr,
    TOKENS_PER_SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP
    ctx = tl.load(lens_ptr + b)
    start = split * TOKENS_PER_SPLIT
    end = tl.minimum(start + TOKENS_PER_SPLIT, ctx)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < DIM
    q = tl.load(q_ptr + b * q_stride_b + head * q_stride_h + dims, mask=dmask, other=0.0).to(tl.float32)
    m_i = tl.max(tl.full([BLOCK_N], NEG, tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < end
        block = tl.load(tables_ptr + b * table_stride + pos // BLOCK_SIZE, mask=pmask, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
        offs = slot[:, None] * (KV_HEADS * DIM) + kv_head * DIM + dims[None, :]
        kv_mask = pmask[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(pmask, s, NEG)
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(pmask, tl.exp(s - m_new), 0.0)
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    part = (b * num_heads + head) * num_splits + split
    tl.store(acc_ptr + part * BLOCK_D + dims, acc)
    tl.store(max_ptr + part, m_i)
    tl.store(sum_ptr + part, l_i)


@triton.jit
def _decode_reduce_kernel(
    acc_ptr,
    max_ptr,
    sum_ptr,
    lens_ptr,
    out_ptr,
    o_stride_b,
    o_stride_h,
    num_heads,
    num_splits,
    DIM: tl.constexpr,
    TOKENS_PER_SPLIT: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    base = (b * num_heads + head) * num_splits
    # Only this sequence's own splits, in index order: how many the grid has (the table width) changes nothing.
    own = tl.cdiv(tl.load(lens_ptr + b), TOKENS_PER_SPLIT)
    m = tl.full([], NEG, tl.float32)
    for s in range(0, own):
        m = tl.maximum(m, tl.load(max_ptr + base + s))
    total = tl.zeros([], tl.float32)
    out = tl.zeros([BLOCK_D], tl.float32)
    for s in range(0, own):
        weight = tl.exp(tl.load(max_ptr + base + s) - m)
        total = total + weight * tl.load(sum_ptr + base + s)
        out = out + weight * tl.load(acc_ptr + (base + s) * BLOCK_D + dims)
    # total == 0 only when the context is empty (no splits): emit zeros instead of 0/0.
    out = out / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * o_stride_b + head * o_stride_h + dims, out.to(out_ptr.dtype.element_ty), mask=dims < DIM)


def num_splits_for(width_tokens: int, tokens_per_split: int) -> int:
    """The grid's splits: enough of ``tokens_per_split`` tokens each to cover the table's width (at least one)."""
    return max(1, -(-width_tokens // tokens_per_split))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    tokens_per_split: int = DEFAULT_TOKENS_PER_SPLIT,
) -> torch.Tensor:
    """Triton twin of kernels.paged_attention.paged_decode (KERN-4, KERN-5); a row is its own (KERN-28)."""
    if tokens_per_split < 1:
        raise ValueError(f"tokens_per_split must be >= 1, got {tokens_per_split}")
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(-1) == 1
    batch, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    splits = num_splits_for(block_tables.shape[1] * block_size, tokens_per_split)
    block_d = triton.next_power_of_2(dim)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    acc = torch.empty(batch, heads, splits, block_d, dtype=torch.float32, device=q.device)
    part_max = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, heads, splits)](
        q,
        k_cache,
        v_cache,
        context_lens,
        block_tables,
        acc,
        part_max,
        part_sum,
        scale,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        heads,
        splits,
        BLOCK_SIZE=block_size,
        KV_HEADS=kv_heads,
        DIM=dim,
        GROUP=heads // kv_heads,
        TOKENS_PER_SPLIT=tokens_per_split,
        BLOCK_N=min(64, triton.next_power_of_2(tokens_per_split)),
        BLOCK_D=block_d,
    )
    _decode_reduce_kernel[(batch, heads)](
        acc,
        part_max,
        part_sum,
        context_lens,
        out,
        out.stride(0),
        out.stride(1),
        heads,
        splits,
        DIM=dim,
        TOKENS_PER_SPLIT=tokens_per_split,
        BLOCK_D=block_d,
    )
    return out
