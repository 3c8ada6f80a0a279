# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Triton paged prefill attention: variable-length causal queries against cached + new KV through block tables.

Invariants: program (b, head, tile) handles queries ``tile * BLOCK_M ..`` of sequence b, whose absolute positions
are ``ctx_b - qlen_b + i`` (queries are the last qlen_b of the context, which serves chunked prefill and prefix-cache
hits alike). It walks keys 0 .. the tile's last visible position in BLOCK_N steps, reading each key through the
block table, masking keys past the context and in the future, with an online softmax in float32. Tiles past qlen_b
store nothing. Operands are widened to float32 before each ``tl.dot``: float32 inputs use ``input_precision="ieee"``
(never silently tf32); fp16/bf16 inputs use tf32 tensor cores, which hold fp16/bf16 values exactly, so q.k^T is
exact and only the softmax weights are rounded (to tf32, finer than the bf16 rounding usual in flash attention).
Widening also keeps the Triton interpreter honest, which mis-multiplies bf16 dot operands. Supported dtypes:
float16, bfloat16, float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NEG = -1.0e30


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    cu_ptr,
    lens_ptr,
    tables_ptr,
    out_ptr,
    scale,
    q_stride_n,
    q_stride_h,
    o_stride_n,
    o_stride_h,
    table_stride,
    BLOCK_SIZE: tl.constexpr,
    KV_HEADS: tl.constexpr,
    DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(cu_ptr + b).to(tl.int64)
    qlen = tl.load(cu_ptr + b + 1).to(tl.int64) - q_start
    ctx = tl.load(lens_ptr + b).to(tl.int64)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < qlen
    q_pos = ctx - qlen + rows
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < DIM
    q_mask = rmask[:, None] & dmask[None, :]
    q = tl.load(
        q_ptr + (q_start + rows)[:, None] * q_stride_n + head * q_stride_h + dims[None, :], mask=q_mask, other=0.0
    ).to(tl.float32)
    m_i = tl.full([BLOCK_M], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys up to the tile's last query position; an empty tile walks no keys.
    last = tl.minimum(ctx, ctx - qlen + (tile + 1) * BLOCK_M)
    last = tl.where(tile * BLOCK_M < qlen, last, 0)
    for n0 in range(0, last, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < ctx
        block = tl.load(tables_ptr + b * table_stride + pos // BLOCK_SIZE, mask=pmask, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
        offs = slot[:, None] * (KV_HEADS * DIM) + kv_head * DIM + dims[None, :]
        kv_mask = pmask[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = pmask[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, NEG)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(visible, tl.exp(s - m_new[:, None]), 0.0)
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_offs = (q_start + rows)[:, None] * o_stride_n + head * o_stride_h + dims[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Triton twin of kernels.paged_attention.paged_prefill (KERN-2, KERN-3, KERN-5)."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(-1) == 1
    _, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    batch = context_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if batch == 0 or q.shape[0] == 0:
        return out
    on_gpu = q.device.type == "cuda"
    bm = block_m or (64 if on_gpu else 16)
    bn = block_n or (64 if on_gpu else 16)
    max_qlen = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
    _prefill_kernel[(batch, heads, triton.cdiv(max_qlen, bm))](
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        context_lens,
        block_tables,
        out,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        BLOCK_SIZE=block_size,
        KV_HEADS=kv_heads,
        DIM=dim,
        GROUP=heads // kv_heads,
        BLOCK_M=bm,
        BLOCK_N=bn,
        # tl.dot needs every dimension >= 16.
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
