# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""A batch-invariant Triton linear: ``y = x @ weight.T + bias`` whose every output row is a function of its own row.

Invariants (KERN-29): one tile configuration whatever M (BLOCK_M x BLOCK_N outputs per program, no autotuning, no
size-dependent choice), no split-K: program (i, j) computes its whole tile, walking K from 0 in fixed BLOCK_K
chunks, each chunk's product added to one float32 accumulator in chunk order, then ``+ bias``. So the additions
that make ``y[m, n]`` depend on K alone, never on M, the row's tile or its place in it, or the other rows' values.
Rows past M and columns past N or K are loaded as zeros and never stored. float32 operands multiply in IEEE
precision; float16/bfloat16 operands are widened to float32 and multiplied in tf32, which holds them exactly, and
the result is rounded to nearest in the input dtype once (through ``round_to``: the interpreter's bfloat16 cast
truncates). Not wired into the engine: its batch-invariant mode still refuses CUDA (BI-7), since no device has run
this end to end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_round import round_to

BLOCK_M = 32
BLOCK_N = 32
BLOCK_K = 32
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    x_stride,
    w_stride,
    y_stride,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * w_stride + ks[None, :], mask=cmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    out_dt: tl.constexpr = y_ptr.dtype.element_ty
    offs = rows[:, None].to(tl.int64) * y_stride + cols[None, :]
    tl.store(y_ptr + offs, round_to(acc, out_dt).to(out_dt), mask=rmask[:, None] & cmask[None, :])


def _check_layer(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.dtype not in DTYPES:
        raise ValueError(f"weight must be float32, float16 or bfloat16, got {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [out_features, in_features], got shape {tuple(weight.shape)}")
    if bias is not None:
        if bias.dtype != weight.dtype or bias.device != weight.device:
            raise ValueError(f"bias must be {weight.dtype} on {weight.device}, got {bias.dtype} on {bias.device}")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must be [{weight.shape[0]}], got shape {tuple(bias.shape)}")


class TritonBoundLinear:
    """``linear(x)`` with its weight and bias checked and made contiguous once (a layer calls it every step)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        _check_layer(weight, bias)
        self.weight = weight.contiguous()
        self.bias = None if bias is None else bias.contiguous()
        self.out_features, self.in_features = self.weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        k, n = self.in_features, self.out_features
        if x.dtype != self.weight.dtype or x.device != self.weight.device or x.dim() < 1 or x.shape[-1] != k:
            raise ValueError(f"x {x.dtype} {tuple(x.shape)} on {x.device} does not fit this layer's "
                             f"[*, {k}] {self.weight.dtype} on {self.weight.device}")  # fmt: skip
        m = x.shape[:-1].numel()
        rows = x.reshape(m, k)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        if m and n:
            grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
            _linear_kernel[grid](
                rows,
                self.weight,
                self.weight if self.bias is None else self.bias,
                y,
                m,
                n,
                k,
                rows.stride(0),
                self.weight.stride(0),
                y.stride(0),
                HAS_BIAS=self.bias is not None,
                BLOCK_M=BLOCK_M,
                BLOCK_N=BLOCK_N,
                BLOCK_K=BLOCK_K,
                PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            )
        return y.reshape(*x.shape[:-1], n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, each output row a function of its own input row alone (KERN-29)."""
    return TritonBoundLinear(weight, bias)(x)
