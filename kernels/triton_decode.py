# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Triton paged decode attention (flash-decoding): one query per sequence, context split, then a reduce.

Invariants: program (b, head, split) covers context positions ``[split * T, min((split + 1) * T, ctx_b))`` with T
``tokens_per_split``; it reads each key through the block table (slot = table[b, j // block_size] * block_size +
j % block_size) so any block size works, and keeps an online softmax in float32 (running max, running sum, running
weighted value). A split with no positions leaves max = NEG, sum = 0, acc = 0, which the reduce weighs to nothing.
The reduce rescales the partials to the global max and divides by the total sum; a sequence with context length 0
(every split empty) gets zeros. The split count depends only on the table width, never on context lengths, so the
launch needs no host sync (CUDA-graph safe). Accumulation is float32 whatever the input dtype (fp16/bf16/fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NEG = -1.0e30
DEFAULT_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64


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
    BLOCK_SIZE: tl.constexpr,
    KV_HEADS: tl.constexpr,
    DIM: tl.constexpr,
    GROUP: tl.constexpr,
    TOKENS_PER_SPLIT: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
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
    part = (b * num_heads + head) * NUM_SPLITS + split
    tl.store(acc_ptr + part * BLOCK_D + dims, acc)
    tl.store(max_ptr + part, m_i)
    tl.store(sum_ptr + part, l_i)


@triton.jit
def _decode_reduce_kernel(
    acc_ptr,
    max_ptr,
    sum_ptr,
    out_ptr,
    o_stride_b,
    o_stride_h,
    num_heads,
    DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    smask = splits < NUM_SPLITS
    dims = tl.arange(0, BLOCK_D)
    base = (b * num_heads + head) * NUM_SPLITS
    m = tl.load(max_ptr + base + splits, mask=smask, other=NEG)
    l_s = tl.load(sum_ptr + base + splits, mask=smask, other=0.0)
    acc = tl.load(acc_ptr + (base + splits)[:, None] * BLOCK_D + dims[None, :], mask=smask[:, None], other=0.0)
    weight = tl.exp(m - tl.max(m, axis=0))
    total = tl.sum(weight * l_s, axis=0)
    # total == 0 only when every split was empty (context length 0): emit zeros instead of 0/0.
    denom = tl.where(total > 0.0, total, 1.0)
    out = tl.sum(weight[:, None] * acc, axis=0) / denom
    tl.store(out_ptr + b * o_stride_b + head * o_stride_h + dims, out.to(out_ptr.dtype.element_ty), mask=dims < DIM)


def num_splits_for(width_tokens: int, tokens_per_split: int) -> int:
    return max(1, min(MAX_SPLITS, -(-width_tokens // tokens_per_split)))


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
    """Triton twin of kernels.paged_attention.paged_decode (KERN-4, KERN-5)."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(-1) == 1
    batch, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    width_tokens = block_tables.shape[1] * block_size
    # Enough splits to cover the widest possible context, each split a whole number of tokens.
    splits = num_splits_for(width_tokens, tokens_per_split)
    per_split = triton.cdiv(width_tokens, splits)
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
        BLOCK_SIZE=block_size,
        KV_HEADS=kv_heads,
        DIM=dim,
        GROUP=heads // kv_heads,
        TOKENS_PER_SPLIT=per_split,
        NUM_SPLITS=splits,
        BLOCK_N=min(64, triton.next_power_of_2(per_split)),
        BLOCK_D=block_d,
    )
    _decode_reduce_kernel[(batch, heads)](
        acc,
        part_max,
        part_sum,
        out,
        out.stride(0),
        out.stride(1),
        heads,
        DIM=dim,
        NUM_SPLITS=splits,
        BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_D=block_d,
    )
    return out
