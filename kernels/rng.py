"""Counter-based random numbers in integer arithmetic, identical in torch and Triton.

Invariants: every value is a 32-bit unsigned quantity held in an int64 lane, so no operation can overflow a signed
64-bit integer — multiplication mod 2**32 is split into 16-bit halves (each partial product < 2**49). ``mix32`` is
the "lowbias32" integer finalizer (xor-shift / multiply rounds with constants 0x7FEB352D and 0x846CA68B), a
bijection on 32-bit words. The uniform for (seed, position, token) is a pure function of those three integers:

    row_key = mix32(mix32(mix32(mix32(seed_lo ^ 0x9E3779B9) ^ seed_hi) ^ pos_lo) ^ pos_hi)
    bits    = mix32(mix32(row_key ^ token) ^ 0x5BD1E995)
    u       = ((bits >> 9) + 0.5) * 2**-23          (float32, exact, strictly inside (0, 1))

where ``x_lo = x & 0xFFFFFFFF`` and ``x_hi = (x >> 32) & 0xFFFFFFFF`` (two's-complement for negative seeds).
The Triton sampler evaluates the same statements (kernels/triton_sampling.py), so u is bit-identical on both paths.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
MIX_C1 = 0x7FEB352D
MIX_C2 = 0x846CA68B
SEED_SALT = 0x9E3779B9
TOKEN_SALT = 0x5BD1E995


def mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for 32-bit x and c, never exceeding 2**49 in an int64 lane."""
    lo = x & 0xFFFF
    hi = x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = mul32(x, MIX_C1)
    x = x ^ (x >> 15)
    x = mul32(x, MIX_C2)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from its (seed, position), int64[B] each (KERN-11)."""
    seed_lo = seeds & MASK32
    seed_hi = (seeds >> 32) & MASK32
    pos_lo = positions & MASK32
    pos_hi = (positions >> 32) & MASK32
    key = mix32(seed_lo ^ SEED_SALT)
    key = mix32(key ^ seed_hi)
    key = mix32(key ^ pos_lo)
    return mix32(key ^ pos_hi)


def uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32[B, vocab] in (0, 1): the uniform of each (row key, token index) (KERN-11)."""
    tokens = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    bits = mix32(mix32(keys[:, None] ^ tokens[None, :]) ^ TOKEN_SALT)
    return ((bits >> 9).to(torch.float32) + 0.5) * (2.0**-23)
