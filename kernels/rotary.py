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


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    # Same operation order as transformers: (x * cos) + (rotate_half(x) * sin), rotate_half(x) = [-x2, x1].
    first = x1 * cos + (-x2) * sin
    second = x2 * cos + x1 * sin
    return torch.cat((first, second), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q[N,h,d]`` and ``k[N,kvh,d]`` by their positions ``int64[N]`` (KERN-9)."""
    half = cos_sin.shape[-1] // 2
    rows = cos_sin[positions]
    cos = rows[:, None, :half]
    sin = rows[:, None, half:]
    return _rotate(q, cos.to(q.dtype), sin.to(q.dtype)), _rotate(k, cos.to(k.dtype), sin.to(k.dtype))
