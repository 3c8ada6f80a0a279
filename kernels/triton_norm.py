# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Triton RMSNorm and fused residual-add + RMSNorm, one program per row.

Invariants: same statement order as kernels.norm — the sum ``x + residual`` is rounded to the input dtype (it is
stored as the new residual and is the norm's input), the mean of squares is accumulated in float32, the normalized
row is rounded to the input dtype before the weight multiply, and the result is written in the promotion of the
weight and input dtypes. Only the float32 reduction order differs from torch, so results agree to float32 rounding
of the variance (a few ulp of the output dtype), not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_round import round_to


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    new_res_ptr,
    x_stride,
    res_stride,
    out_stride,
    new_res_stride,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    in_dt: tl.constexpr = x_ptr.dtype.element_ty
    out_dt: tl.constexpr = out_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        h = round_to(h + r, in_dt)
        tl.store(new_res_ptr + row * new_res_stride + cols, h.to(in_dt), mask=mask)
    variance = tl.sum(h * h, axis=0) / HIDDEN
    normed = round_to(h * tl.rsqrt(variance + eps), in_dt)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, round_to(w * normed, out_dt).to(out_dt), mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), "triton norm supports fp16/bf16/fp32"
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    assert x2.stride(-1) == 1
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    new_res = torch.empty_like(x2) if residual is not None else x2
    r2 = residual.reshape(-1, hidden) if residual is not None else x2
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out,
            new_res,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            new_res.stride(0),
            eps,
            HIDDEN=hidden,
            BLOCK=triton.next_power_of_2(hidden),
            HAS_RESIDUAL=residual is not None,
        )
    return out.reshape(x.shape), new_res.reshape(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton twin of kernels.norm.rms_norm (KERN-6)."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of kernels.norm.add_rms_norm (KERN-7)."""
    return _launch(x, residual, weight, eps)
