# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Triton sampler: greedy argmax, temperature, the top-k/top-p keep mask, and the seeded exponential race.

Invariants: one program per row, two passes over the vocabulary in BLOCK_V chunks. Pass 1 finds the maximum of
``z = logits / T`` over kept tokens and its lowest index (for T == 0 that is the greedy token, since z = logits).
Pass 2 (T > 0 only) computes each kept token's race key ``exp(z - max) / -log(u)`` with u from the same integer
hash as kernels/rng.py (statement for statement, in int64 lanes holding 32-bit values, so u is bit-identical) and
keeps the lowest index of the largest key. The keys omit the softmax normaliser, a positive constant per row, so the
argmax is the torch path's up to float rounding of exp/log/division: the two paths pick the same token except when
two keys are within a few float32 ulp of each other. Top-k / top-p use the torch sort-based keep mask
(kernels.sampling), computed only when some row asks for them: sorting a 150k vocabulary inside one Triton program
is not worth its complexity, and sharing the mask keeps the filter bit-identical.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import rng
from kernels.sampling import filter_top_k, top_p_keep

_MASK32 = tl.constexpr(rng.MASK32)
_C1 = tl.constexpr(rng.MIX_C1)
_C2 = tl.constexpr(rng.MIX_C2)
_SEED_SALT = tl.constexpr(rng.SEED_SALT)
_TOKEN_SALT = tl.constexpr(rng.TOKEN_SALT)


@triton.jit
def _mul32(x, c: tl.constexpr):
    lo = x & 0xFFFF
    hi = x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _MASK32


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


@triton.jit
def _row_key(seed, position):
    key = _mix32((seed & _MASK32) ^ _SEED_SALT)
    key = _mix32(key ^ ((seed >> 32) & _MASK32))
    key = _mix32(key ^ (position & _MASK32))
    return _mix32(key ^ ((position >> 32) & _MASK32))


@triton.jit
def _uniform(key, tokens):
    bits = _mix32(_mix32(key ^ tokens) ^ _TOKEN_SALT)
    return ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _sample_kernel(
    logits_ptr,
    keep_ptr,
    temp_ptr,
    seed_ptr,
    pos_ptr,
    out_ptr,
    u_ptr,
    logits_stride,
    keep_stride,
    vocab,
    HAS_KEEP: tl.constexpr,
    WRITE_U: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temp_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    best = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), axis=0)
    best_idx = tl.sum(tl.zeros([BLOCK_V], tl.int64), axis=0)
    for v0 in range(0, vocab, BLOCK_V):
        tokens = v0 + cols
        kept = tokens < vocab
        if HAS_KEEP:
            kept = kept & (tl.load(keep_ptr + row * keep_stride + tokens, mask=tokens < vocab, other=0) != 0)
        z = tl.load(logits_ptr + row * logits_stride + tokens, mask=tokens < vocab, other=0.0).to(tl.float32)
        z = tl.where(kept, z / tl.where(temperature > 0.0, temperature, 1.0), float("-inf"))
        chunk_best = tl.max(z, axis=0)
        if chunk_best > best:
            best = chunk_best
            best_idx = v0 + tl.argmax(z, axis=0).to(tl.int64)
    if temperature > 0.0:
        key = _row_key(tl.load(seed_ptr + row), tl.load(pos_ptr + row))
        race_best = tl.max(tl.full([BLOCK_V], -1.0, tl.float32), axis=0)
        for v0 in range(0, vocab, BLOCK_V):
            tokens = v0 + cols
            kept = tokens < vocab
            if HAS_KEEP:
                kept = kept & (tl.load(keep_ptr + row * keep_stride + tokens, mask=tokens < vocab, other=0) != 0)
            z = tl.load(logits_ptr + row * logits_stride + tokens, mask=tokens < vocab, other=0.0).to(tl.float32)
            u = _uniform(key, tokens.to(tl.int64))
            if WRITE_U:
                tl.store(u_ptr + row * vocab + tokens, u, mask=tokens < vocab)
            race = tl.where(kept, tl.exp(z / temperature - best) / -tl.log(u), -1.0)
            chunk_best = tl.max(race, axis=0)
            if chunk_best > race_best:
                race_best = chunk_best
                best_idx = v0 + tl.argmax(race, axis=0).to(tl.int64)
    tl.store(out_ptr + row, best_idx)


def keep_mask(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor | None:
    """int8[B,V] tokens kept by top-k/top-p (the torch definition), or None when no row filters."""
    if not bool(((top_k > 0) | (top_p < 1.0)).any()):
        return None
    safe_t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    z = filter_top_k(logits.to(torch.float32) / safe_t[:, None], top_k)
    keep = top_p_keep(torch.softmax(z, dim=-1), top_p) & (z > float("-inf"))
    # Greedy rows ignore filters (temperature 0 is plain argmax in the torch path too).
    return (keep | (temperature[:, None] <= 0)).to(torch.int8)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor | None = None,
    uniforms_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton twin of kernels.sampling.sample (KERN-10..KERN-14). ``uniforms_out`` (float32[B,V]) receives the
    hash uniforms of sampled rows, for checking bit-identity with kernels.rng."""
    assert logits.stride(-1) == 1
    batch, vocab = logits.shape
    if out is None:
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    keep = keep_mask(logits, temperature, top_k, top_p)
    keep_arg = keep if keep is not None else logits
    _sample_kernel[(batch,)](
        logits,
        keep_arg,
        temperature,
        seeds,
        positions,
        out,
        uniforms_out if uniforms_out is not None else logits,
        logits.stride(0),
        keep_arg.stride(0),
        vocab,
        HAS_KEEP=keep is not None,
        WRITE_U=uniforms_out is not None,
        BLOCK_V=min(1024, triton.next_power_of_2(vocab)),
    )
    return out
