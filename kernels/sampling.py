"""Token sampling: greedy, temperature, top-k, top-p and a seeded counter-based draw; torch implementation.

Invariants: each row is sampled from its own logits, temperature, top-k, top-p, seed and position only — no state,
no global generator — so a seeded request draws the same token alone or in any batch. Temperature 0 is argmax
(lowest index among ties). Otherwise, in float32: ``z = logits / T``; top-k keeps tokens whose z is >= the k-th
largest z (ties at the boundary kept); ``p = softmax(z over kept)``; top-p (active when < 1) sorts p descending
(stable), finds the first rank r whose inclusive cumulative sum is >= top_p and keeps tokens with ``p >= p_(r)``;
the token is ``argmax_i p_i / E_i`` over kept tokens with ``E_i = -log(u_i)``, u from kernels/rng.py — an
exponential race, which selects token i with probability proportional to p_i (lowest index among exact ties).
"""

from __future__ import annotations

import torch

from kernels.rng import row_keys, uniforms


def filter_top_k(z: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Set to -inf every z below its row's k-th largest value; rows with k <= 0 or k >= V unchanged (KERN-12)."""
    vocab = z.shape[-1]
    active = (top_k > 0) & (top_k < vocab)
    k = torch.where(active, top_k, vocab).clamp(1, vocab)
    sorted_z = torch.sort(z, dim=-1, descending=True).values
    kth = sorted_z.gather(-1, (k - 1)[:, None])
    return z.masked_fill(active[:, None] & (z < kth), float("-inf"))


def top_p_keep(p: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Boolean mask of tokens kept by nucleus filtering; rows with top_p >= 1 keep everything (KERN-13)."""
    sorted_p = torch.sort(p, dim=-1, descending=True, stable=True).values
    cumulative = torch.cumsum(sorted_p, dim=-1)
    reached = cumulative >= top_p[:, None]
    # First rank reaching top_p; if rounding never reaches it, the last rank (keep everything).
    rank = torch.where(reached.any(dim=-1), reached.int().argmax(dim=-1), p.shape[-1] - 1)
    threshold = sorted_p.gather(-1, rank[:, None].long())
    return (p >= threshold) | (top_p[:, None] >= 1.0)


def filtered_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """float32[B,V] probabilities after temperature, top-k and top-p; filtered tokens are exactly 0."""
    safe_t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    z = filter_top_k(logits.to(torch.float32) / safe_t[:, None], top_k)
    p = torch.softmax(z, dim=-1)
    return torch.where(top_p_keep(p, top_p), p, torch.zeros_like(p))


def race(p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``argmax_i p_i / -log(u_i)`` per row: the seeded exponential race (KERN-11)."""
    u = uniforms(row_keys(seeds, positions), p.shape[-1])
    return (p / -torch.log(u)).argmax(dim=-1)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """int64[B] next tokens (KERN-10..KERN-13)."""
    greedy = logits.argmax(dim=-1)
    drawn = race(filtered_probs(logits, temperature, top_k, top_p), seeds, positions)
    return torch.where(temperature > 0, drawn, greedy)


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """The raw distribution's log probabilities, row by row (ENG-19): ``log_softmax`` over the vocabulary in
    float32, or float64 for float64 logits. torch computes each row alone (its max, then its sum of exp, in one
    vector order per row; threads split rows, never a row), so a row's bits do not depend on its batch."""
    wide = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return torch.log_softmax(logits.to(wide).contiguous(), dim=-1)


def top_logprobs(lp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int64[R,k] token ids and their [R,k] log probabilities: each row's k most likely tokens by descending
    logprob, ties (the boundary's too) by ascending token id (ENG-19). ``k`` is at most the vocabulary."""
    rows = lp.shape[0]
    lp = torch.nan_to_num(lp, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))  # a NaN ranks last
    if k == 0:
        return torch.zeros(rows, 0, dtype=torch.int64), lp[:, :0]
    kth = torch.topk(lp, k, dim=-1).values[:, -1:]  # the k-th largest value; its ties are resolved by id below
    above = lp > kth
    tied = lp == kth
    room = k - above.sum(dim=-1, keepdim=True)
    keep = above | (tied & (torch.cumsum(tied, dim=-1) <= room))  # exactly k per row: the lowest tied ids
    ids = keep.nonzero()[:, 1].reshape(rows, k)  # ascending ids within each row
    values = lp.gather(-1, ids)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices  # stable: ties keep id order
    return ids.gather(-1, order), values.gather(-1, order)


def token_ranks(lp: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``tokens`` logprob and its 1-based rank in that row (ties by token id, as ``top_logprobs``)."""
    chosen = lp.gather(-1, tokens[:, None])
    ids = torch.arange(lp.shape[-1], device=lp.device)
    ahead = (lp > chosen) | ((lp == chosen) & (ids[None, :] < tokens[:, None]))
    return chosen[:, 0], ahead.sum(dim=-1) + 1
