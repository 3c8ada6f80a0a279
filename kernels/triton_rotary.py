# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Triton rotary embedding (rotate-half), one program per (token, head); returns new tensors.

Invariants: each product and sum is rounded to the tensor dtype exactly where torch's elementwise ops round — for
fp16/bf16 the float32 products of two 16-bit values are exact, so rounding once afterwards equals torch; for float32
the float32 ops are torch's ops — so the result is bit-identical to kernels.rotary.apply_rotary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_round import round_to


@triton.jit
def _rotary_kernel(
    x_ptr,
    out_ptr,
    pos_ptr,
    cs_ptr,
    x_stride_n,
    x_stride_h,
    o_stride_n,
    o_stride_h,
    cs_stride,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    dt: tl.constexpr = x_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + row).to(tl.int64)
    cos = round_to(tl.load(cs_ptr + pos * cs_stride + cols, mask=mask, other=0.0).to(tl.float32), dt)
    sin = round_to(tl.load(cs_ptr + pos * cs_stride + HALF + cols, mask=mask, other=0.0).to(tl.float32), dt)
    base = x_ptr + row * x_stride_n + head * x_stride_h
    x1 = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    first = round_to(x1 * cos, dt) + round_to((-x2) * sin, dt)
    second = round_to(x2 * cos, dt) + round_to(x1 * sin, dt)
    obase = out_ptr + row * o_stride_n + head * o_stride_h
    tl.store(obase + cols, round_to(first, dt).to(dt), mask=mask)
    tl.store(obase + HALF + cols, round_to(second, dt).to(dt), mask=mask)


def _rotate(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), "triton rotary supports fp16/bf16/fp32"
    assert x.stride(-1) == 1 and cos_sin.stride(-1) == 1
    out = torch.empty_like(x)
    rows, heads, dim = x.shape
    if rows > 0:
        _rotary_kernel[(rows, heads)](
            x,
            out,
            positions,
            cos_sin,
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            cos_sin.stride(0),
            HALF=dim // 2,
            BLOCK=triton.next_power_of_2(dim // 2),
        )
    return out


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of kernels.rotary.apply_rotary (KERN-9)."""
    return _rotate(q, positions, cos_sin), _rotate(k, positions, cos_sin)
