"""RMSNorm and fused residual-add + RMSNorm, torch implementations (the oracle for the Triton kernels).

Invariants: the arithmetic is transformers' Qwen3RMSNorm / LlamaRMSNorm statement for statement — the input is
upcast to float32, the mean of squares is taken over the last dimension, multiplied by ``rsqrt(var + eps)``, cast
back to the input dtype, and only then multiplied by the weight (so the result dtype is the promotion of weight and
input dtypes). ``add_rms_norm`` adds in the input dtype first; the sum is both the new residual and the norm's input.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, bit-identical to transformers' eager RMSNorm (KERN-6)."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)`` (KERN-7)."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual
