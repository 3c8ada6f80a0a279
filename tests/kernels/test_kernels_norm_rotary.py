"""RMSNorm and rotary embedding: torch against transformers' own modules (bit for bit), Triton against torch.

The torch-versus-transformers tests run on the CPU; the Triton tests draw their inputs on the CPU (the same numbers
on every device) and run the kernel and its torch twin on the ``device`` fixture (tests/kernels/conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb

from kernels import norm, rotary, triton_norm, triton_rotary

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _weight(hidden: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.rand(hidden) + 0.5).to(dtype)


@pytest.mark.clause("KERN-6", "KERN-7")
@pytest.mark.parametrize("dtype", [torch.float64, *DTYPES])
def test_rms_norm_is_transformers_rms_norm(dtype: torch.dtype) -> None:
    """KERN-6, KERN-7: torch rms_norm and add_rms_norm are bit-identical to Qwen3RMSNorm (residual added first)."""
    module = Qwen3RMSNorm(24, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.copy_(_weight(24, dtype))
    x = torch.randn(5, 3, 24).to(dtype)
    residual = torch.randn(5, 3, 24).to(dtype)
    with torch.no_grad():
        assert torch.equal(norm.rms_norm(x, module.weight, 1e-6), module(x))
        out, new_residual = norm.add_rms_norm(x, residual, module.weight, 1e-6)
        assert torch.equal(new_residual, residual + x)
        assert torch.equal(out, module(residual + x))


# KERN-6's bound, in ulp of the output dtype: the largest error measured (float32: 5 ulp over 7.7 million outputs).
NORM_ULPS = {torch.float32: 5, torch.bfloat16: 2, torch.float16: 2}


def ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at each value of ``ref``, in float64: eps * 2**floor(log2|x|), subnormals as tiny."""
    info = torch.finfo(dtype)
    return info.eps * torch.exp2(torch.floor(torch.log2(ref.double().abs().clamp_min(info.tiny))))


def ulps(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest |out - ref| in ulp of ``dtype`` at ``ref``, computed in float64."""
    return float(((out.double() - ref.double()).abs() / ulp(ref, dtype)).max())


@pytest.mark.clause("KERN-6")
@pytest.mark.parametrize("dtype", DTYPES)
def test_ulp_is_the_spacing_of_the_dtype(dtype: torch.dtype) -> None:
    """KERN-6: the measuring stick: one step of nextafter is one ulp; zero and subnormals use the smallest normal."""
    info = torch.finfo(dtype)
    x = torch.cat([torch.randn(200), torch.tensor([1.0, -1.0, 0.75, info.tiny, info.max / 2])]).to(dtype)
    step = torch.nextafter(x, torch.full_like(x, float("inf"))).double() - x.double()
    up = x.double() > 0  # going up from a positive value stays in its binade or steps by its own spacing
    assert torch.equal(step[up], ulp(x, dtype)[up])
    zero = torch.zeros(1, dtype=dtype)
    assert ulp(zero, dtype).item() == info.eps * info.tiny
    assert ulp(torch.tensor([1.0]), dtype).item() == info.eps
    assert ulps(torch.tensor([1.0 + 3 * info.eps]), torch.tensor([1.0]), dtype) == 3


@pytest.mark.clause("KERN-6", "KERN-7")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [24, 64, 100])
def test_triton_norms_equal_torch(dtype: torch.dtype, hidden: int, device: torch.device) -> None:
    """KERN-6, KERN-7: the residual sum is bit-identical; the norm is within KERN-6's ulp bound of the output dtype."""
    x = torch.randn(7, hidden).to(dtype).to(device)
    residual = torch.randn(7, hidden).to(dtype).to(device)
    weight = _weight(hidden, dtype).to(device)
    out, new_residual = triton_norm.add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_residual = norm.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, ref_residual)
    assert out.dtype == ref_out.dtype == dtype
    assert ulps(out, ref_out, dtype) <= NORM_ULPS[dtype]
    # A float32 weight with a 16-bit input promotes the output to float32, as in transformers; the normalized row
    # is still rounded to the input dtype first, so a 16-bit input's bound is in its own ulp (plus float32's).
    plain = triton_norm.rms_norm(x, weight.float(), 1e-6)
    ref_plain = norm.rms_norm(x, weight.float(), 1e-6)
    assert plain.dtype == ref_plain.dtype == torch.float32
    err = (plain.double() - ref_plain.double()).abs()
    if dtype == torch.float32:
        bound = NORM_ULPS[dtype] * ulp(ref_plain, dtype)
    else:
        bound = NORM_ULPS[dtype] * ulp(ref_plain, dtype) + ulp(ref_plain, torch.float32)
    assert bool((err <= bound).all()), ulps(plain, ref_plain, dtype)


@pytest.mark.clause("KERN-8", "KERN-9")
@pytest.mark.parametrize("dtype", [torch.float64, *DTYPES])
def test_rotary_is_transformers_rotary(dtype: torch.dtype) -> None:
    """KERN-8, KERN-9: the cos|sin table and the rotation are bit-identical to Qwen3RotaryEmbedding + apply."""
    head_dim, heads, kv_heads = 16, 4, 2
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0}
    config = Qwen3Config(head_dim=head_dim, max_position_embeddings=64, rope_parameters=rope)
    positions = torch.tensor([0, 5, 63, 17, 2])
    q = torch.randn(5, heads, head_dim).to(dtype)
    k = torch.randn(5, kv_heads, head_dim).to(dtype)
    cos, sin = Qwen3RotaryEmbedding(config)(q, positions[None, :])
    table = rotary.rotary_cos_sin(head_dim, 64, 1_000_000.0, dtype, CPU)
    assert torch.equal(table[positions], torch.cat((cos[0, :, : head_dim // 2], sin[0, :, : head_dim // 2]), -1))
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = rotary.apply_rotary(q, k, positions, table)
    assert torch.equal(q_out, q_ref[0].transpose(0, 1))
    assert torch.equal(k_out, k_ref[0].transpose(0, 1))


@pytest.mark.clause("KERN-9")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (3, 1, 12)])
def test_triton_rotary_is_bit_identical(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, device: torch.device
) -> None:
    """KERN-9: the Triton rotation rounds where torch rounds, so it is bit-identical in every dtype."""
    table = rotary.rotary_cos_sin(head_dim, 100, 10_000.0, dtype, CPU).to(device)
    positions = torch.randint(0, 100, (9,)).to(device)
    q = torch.randn(9, heads, head_dim).to(dtype).to(device)
    k = torch.randn(9, kv_heads, head_dim).to(dtype).to(device)
    q_out, k_out = triton_rotary.apply_rotary(q, k, positions, table)
    q_ref, k_ref = rotary.apply_rotary(q, k, positions, table)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
