"""Rotary position embedding (rotate-half / GPT-NeoX style), torch implementation.

Invariants: ``rotary_cos_sin`` reproduces transformers' default RoPE arithmetic — inverse frequencies computed in
float32 on the CPU as ``1 / theta ** (arange(0, d, 2) / d)``, angles ``position * inv_freq`` in float32 on the target
device, cos and sin in float32, then cast to the model dtype. The table stores only the distinct half of each:
row p is ``[cos(angles_p) | sin(angles_p)]`` (transformers duplicates each half). ``apply_rotary`` computes
``x * cos + rotate_half(x) * sin`` in the tensor's own dtype, elementwise, exactly as transformers'
``apply_rotary_pos_emb`` does, and returns new tensors (inputs are not modified).
"""

from __future__ import annotations

import torch


def rotary_cos_sin(
    head_dim: int, max_position: int, theta: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Table ``[max_position, head_dim]`` whose row p is ``cos | sin`` of p's angles (KERN-8)."""
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")
    if max_position < 1:
        raise ValueError(f"max_position must be >= 1, got {max_position}")
    # transformers builds inv_freq at model init on the CPU, in float32.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    positions = torch.arange(max_position, device=device).float()
    freqs = positions[:, None] * inv_freq.to(device=device, dtype=torch.float)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def rotary_rows(
    positions: torch.Tensor, cos_sin: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of each position, ``[N, 1, head_dim // 2]`` in ``dtype``: one lookup per step, shared by all
    layers and by q and k."""
    half = cos_sin.shape[-1] // 2
    rows = cos_sin[positions]
    return rows[:, None, :half].to(dtype), rows[:, None, half:].to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x[N, heads, d]`` (KERN-9), into a new tensor.

    ``rotate_half(x) = [-x2, x1]``, so the first half is ``x1 * cos + (-x2) * sin``, written ``x1 * cos - x2 * sin``:
    ``a + (-b)`` and ``a - b`` are the same IEEE operation, so the result is bit-identical without the negation, and
    each half is written in place of a concatenation."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    first, second = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=first)
    first.sub_(x2 * sin)
    torch.mul(x2, cos, out=second)
    second.add_(x1 * sin)
    return out


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q[N,h,d]`` and ``k[N,kvh,d]`` by their positions ``int64[N]`` (KERN-9)."""
    cos, sin = rotary_rows(positions, cos_sin, q.dtype)
    if k.dtype != q.dtype:
        return rotate(q, cos, sin), rotate(k, *rotary_rows(positions, cos_sin, k.dtype))
    return rotate(q, cos, sin), rotate(k, cos, sin)
