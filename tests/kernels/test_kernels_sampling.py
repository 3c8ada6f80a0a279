"""The sampler: greedy, top-k, top-p, the counter-based RNG (pinned against a pure-Python statement of the spec),
batch independence, the race's distribution, and the Triton sampler against torch.

The torch sampler's own tests run on the CPU; the Triton test draws its inputs on the CPU (the same numbers on every
device) and runs the kernel, the torch sampler and the torch RNG it is compared with on the ``device`` fixture.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import rng, sampling, triton_sampling

M32 = 0xFFFFFFFF


def py_mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def py_uniform(seed: int, position: int, token: int) -> float:
    """spec/kernels.md KERN-11, in unbounded Python integers."""
    key = py_mix32((seed & M32) ^ 0x9E3779B9)
    key = py_mix32(key ^ ((seed >> 32) & M32))
    key = py_mix32(key ^ (position & M32))
    key = py_mix32(key ^ ((position >> 32) & M32))
    bits = py_mix32(py_mix32(key ^ token) ^ 0x5BD1E995)
    return ((bits >> 9) + 0.5) * 2.0**-23


@pytest.mark.clause("KERN-11")
def test_rng_matches_pure_python_statement_of_spec() -> None:
    """KERN-11: the int64-lane hash equals the spec's uint32 definition, including negative and 64-bit seeds."""
    seeds = torch.tensor([0, 1, -5, 2**40 + 7, -(2**63)])
    positions = torch.tensor([0, 3, 2**33, 12345, 2**62])
    u = rng.uniforms(rng.row_keys(seeds, positions), 37)
    for row, (seed, pos) in enumerate(zip(seeds.tolist(), positions.tolist(), strict=True)):
        for token in (0, 1, 17, 36):
            assert u[row, token].item() == py_uniform(seed, pos, token)
    assert bool((u > 0).all()) and bool((u < 1).all())


def _params(batch: int, temperature: float, top_k: int = -1, top_p: float = 1.0) -> tuple[torch.Tensor, ...]:
    return (
        torch.full((batch,), temperature),
        torch.full((batch,), top_k, dtype=torch.int64),
        torch.full((batch,), top_p),
    )


@pytest.mark.clause("KERN-10")
def test_greedy_is_argmax() -> None:
    """KERN-10: temperature 0 is argmax, whatever top-k, top-p and seed say."""
    logits = torch.randn(6, 50)
    temperature, _, _ = _params(6, 0.0)
    tokens = sampling.sample(
        logits, temperature, torch.full((6,), 3), torch.full((6,), 0.2), torch.arange(6), torch.arange(6)
    )
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.clause("KERN-11")
def test_seeded_draw_is_independent_of_batch_composition() -> None:
    """KERN-11: a row's token depends on its own (logits, seed, position, params) only, alone or in any batch."""
    logits = torch.randn(8, 300) * 2
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0, 0.9, 2.0, 1.0])
    top_k = torch.tensor([-1, 5, -1, 40, -1, 3, -1, 100])
    top_p = torch.tensor([1.0, 1.0, 0.5, 0.9, 0.3, 1.0, 0.95, 1.0])
    seeds = torch.tensor([11, 12, 13, 14, 15, 16, 17, 18])
    positions = torch.tensor([0, 5, 9, 100, 7, 7, 3, 2])
    batched = sampling.sample(logits, temperature, top_k, top_p, seeds, positions)
    order = torch.randperm(8)
    permuted = sampling.sample(
        logits[order], temperature[order], top_k[order], top_p[order], seeds[order], positions[order]
    )
    assert torch.equal(permuted, batched[order])
    for row in range(8):
        alone = sampling.sample(*(t[row : row + 1] for t in (logits, temperature, top_k, top_p, seeds, positions)))
        assert alone.item() == batched[row].item()
    other_seed = sampling.sample(logits, temperature, top_k, top_p, seeds + 1000, positions)
    assert not torch.equal(other_seed, batched)  # the seed matters (8 rows of 300-way draws)


@pytest.mark.clause("KERN-12")
def test_top_k_keeps_only_the_k_largest() -> None:
    """KERN-12: with top-k every drawn token is among the k largest logits."""
    logits = torch.randn(1, 100).expand(400, 100).contiguous()
    temperature, top_k, top_p = _params(400, 5.0, top_k=4)
    tokens = sampling.sample(logits, temperature, top_k, top_p, torch.arange(400), torch.zeros(400, dtype=torch.int64))
    allowed = set(logits[0].topk(4).indices.tolist())
    assert set(tokens.tolist()) == allowed  # at temperature 5 over 400 draws, each of the 4 appears


@pytest.mark.clause("KERN-13")
def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    """KERN-13: top-p keeps the most probable tokens up to the first whose cumulative probability reaches p."""
    probs = torch.tensor([[0.05, 0.4, 0.3, 0.15, 0.1]])
    keep = sampling.top_p_keep(probs, torch.tensor([0.7]))
    assert keep.tolist() == [[False, True, True, False, False]]
    keep = sampling.top_p_keep(probs, torch.tensor([0.71]))
    assert keep.tolist() == [[False, True, True, True, False]]
    keep = sampling.top_p_keep(probs, torch.tensor([0.1]))
    assert keep.tolist() == [[False, True, False, False, False]]
    assert sampling.top_p_keep(probs, torch.tensor([1.0])).all()
    logits = probs.log().expand(300, 5).contiguous()
    temperature, top_k, top_p = _params(300, 1.0, top_p=0.7)
    tokens = sampling.sample(logits, temperature, top_k, top_p, torch.arange(300), torch.arange(300))
    assert set(tokens.tolist()) == {1, 2}


@pytest.mark.clause("KERN-11")
def test_race_frequencies_follow_the_distribution() -> None:
    """KERN-11: over many (seed, position) pairs the exponential race picks token i with probability p_i."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    draws = 4000
    logits = probs.log().expand(draws, 4).contiguous()
    temperature, top_k, top_p = _params(draws, 1.0)
    tokens = sampling.sample(logits, temperature, top_k, top_p, torch.full((draws,), 7), torch.arange(draws))
    counts = torch.bincount(tokens, minlength=4).double()
    expected = probs.double() * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3, (counts.tolist(), chi2)  # 99.9th percentile of chi-square with 3 degrees of freedom
    assert math.isclose(float(counts.sum()), draws)


@pytest.mark.clause("KERN-14")
@pytest.mark.parametrize("vocab", [300, 2500])
def test_triton_sampler_equals_torch(vocab: int, device: torch.device) -> None:
    """KERN-14: the Triton sampler's uniforms are bit-identical and its tokens equal the torch sampler's."""
    batch = 6
    logits = (torch.randn(batch, vocab) * 3).to(device)
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.0, 2.0, 0.5]).to(device)
    top_k = torch.tensor([-1, 5, -1, 3, -1, 50]).to(device)
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5, 1.0, 0.8]).to(device)
    seeds = torch.tensor([1, 2, 3, 4, -5, 2**40 + 7]).to(device)
    positions = torch.tensor([5, 6, 7, 8, 9, 2**33]).to(device)
    uniforms = torch.full((batch, vocab), float("nan")).to(device)
    out = torch.full((batch,), -7, dtype=torch.int64).to(device)
    tokens = triton_sampling.sample(logits, temperature, top_k, top_p, seeds, positions, out=out, uniforms_out=uniforms)
    assert torch.equal(tokens, sampling.sample(logits, temperature, top_k, top_p, seeds, positions))
    sampled_rows = temperature > 0
    expected_u = rng.uniforms(rng.row_keys(seeds, positions), vocab)
    assert torch.equal(uniforms[sampled_rows], expected_u[sampled_rows])
    # No filtering: the kernel runs without a keep mask.
    plain_t, plain_k, plain_p = (t.to(device) for t in _params(batch, 1.0))
    plain = triton_sampling.sample(logits, plain_t, plain_k, plain_p, seeds, positions)
    assert torch.equal(plain, sampling.sample(logits, plain_t, plain_k, plain_p, seeds, positions))
