"""The Triton kernels' rows are their own (KERN-28, KERN-29): the same bits alone as in any batch.

Run like every Triton test here: interpreted on the CPU, compiled on the device named by NANOVERIFY_KERNEL_DEVICE
(gpu-check's ``kernels-invariant`` stage, GPU-4). Inputs are drawn on the CPU and moved to the ``device`` fixture;
outputs are poisoned with NaN before each call. Shapes are tiny, because the interpreter is slow.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernels import triton_decode, triton_linear, triton_prefill
from tests.kernels.test_kernels_attention import cu_seqlens, make_case

DTYPES = [torch.float32, torch.bfloat16]
HEADS = [(2, 1), (4, 2), (3, 3)]  # (query heads, KV heads): GQA 2 and 2, and none


def _decode(q: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor], lens: torch.Tensor, tables: torch.Tensor,
            tokens_per_split: int) -> torch.Tensor:  # fmt: skip
    return triton_decode.paged_decode(q, *caches, lens, tables, 0.3, out=torch.full_like(q, float("nan")),
                                      tokens_per_split=tokens_per_split)  # fmt: skip


@pytest.mark.clause("KERN-28")
@settings(max_examples=12, deadline=None)
@given(
    ctx=st.integers(0, 30),
    mates=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    place=st.integers(0, 3),
    block_size=st.sampled_from([1, 2, 3, 5]),
    tokens_per_split=st.integers(1, 9),
    heads=st.sampled_from(HEADS),
    dim=st.sampled_from([4, 6, 8]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
# A row whose own table is 3 blocks of 2 beside a mate 13 blocks long: under the old width-derived split size
# (ceil(width / ceil(width / T))) the row alone was cut into splits of 3 tokens and in the batch into splits of 4.
@example(ctx=5, mates=[25], place=0, block_size=2, tokens_per_split=4, heads=(2, 1), dim=4, dtype=torch.float32,
         seed=0)  # fmt: skip
def test_triton_decode_row_alone_equals_its_row_in_any_batch(
    ctx: int,
    mates: list[int],
    place: int,
    block_size: int,
    tokens_per_split: int,
    heads: tuple[int, int],
    dim: int,
    dtype: torch.dtype,
    seed: int,
    device: torch.device,
) -> None:
    """KERN-28: a decode row is bit for bit the same alone (its table trimmed to its own blocks) as at any place in
    a batch whose longer mates widen the table (padded with -1 past each row's blocks)."""
    place = min(place, len(mates))
    lens = [*mates[:place], ctx, *mates[place:]]
    q_heads, kv_heads = heads
    case = make_case(lens, block_size, kv_heads, dim, dtype, seed=seed).to(device)
    q = torch.randn(len(lens), q_heads, dim, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)
    caches = (case.k_cache, case.v_cache)
    batch = _decode(q, caches, case.context_lens, case.block_tables, tokens_per_split)
    own_blocks = max(1, -(-ctx // block_size))
    own_table = case.block_tables[place : place + 1, :own_blocks].contiguous()
    alone = _decode(q[place : place + 1], caches, case.context_lens[place : place + 1], own_table, tokens_per_split)
    assert torch.equal(alone[0], batch[place]), (alone[0] - batch[place]).abs().max()


def _prefill(q: torch.Tensor, qlens: list[int], lens: list[int], tables: torch.Tensor, case_caches: tuple[
        torch.Tensor, torch.Tensor], device: torch.device) -> torch.Tensor:  # fmt: skip
    cu = cu_seqlens(qlens).to(device)
    ctx = torch.tensor(lens, dtype=torch.int32).to(device)
    return triton_prefill.paged_prefill(q, *case_caches, cu, ctx, tables, 0.3, out=torch.full_like(q, float("nan")))


@pytest.mark.clause("KERN-28")
@settings(max_examples=8, deadline=None)
@given(
    prompt=st.integers(1, 40),
    cut=st.integers(1, 39),
    mates=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30)), min_size=1, max_size=2),
    place=st.integers(0, 2),
    block_size=st.sampled_from([1, 3, 4]),
    heads=st.sampled_from(HEADS),
    dim=st.sampled_from([4, 8]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_triton_prefill_rows_are_the_same_alone_in_a_batch_and_chunked(
    prompt: int,
    cut: int,
    mates: list[tuple[int, int]],
    place: int,
    block_size: int,
    heads: tuple[int, int],
    dim: int,
    dtype: torch.dtype,
    seed: int,
    device: torch.device,
) -> None:
    """KERN-28: a prompt's prefill rows are bit for bit the same computed alone and whole, beside other sequences
    (their own chunks of other lengths) at any place in the batch, and in two chunks cut anywhere (the second chunk
    reading the first's keys from the cache)."""
    place = min(place, len(mates))
    mate_ctx = [max(c, q) for c, q in mates]
    lens = [*mate_ctx[:place], prompt, *mate_ctx[place:]]
    qlens = [*[q for _, q in mates][:place], prompt, *[q for _, q in mates][place:]]
    q_heads, kv_heads = heads
    case = make_case(lens, block_size, kv_heads, dim, dtype, seed=seed).to(device)
    caches = (case.k_cache, case.v_cache)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(qlens), q_heads, dim, generator=gen).to(dtype).to(device)
    first = sum(qlens[:place])
    own_q = q[first : first + prompt]
    own_table = case.block_tables[place : place + 1].contiguous()
    alone = _prefill(own_q, [prompt], [prompt], own_table, caches, device)
    batch = _prefill(q, qlens, lens, case.block_tables, caches, device)
    assert torch.equal(batch[first : first + prompt], alone), "a row changed with its batch mates"
    cut = min(cut, prompt - 1)
    if cut >= 1:
        head = _prefill(own_q[:cut].contiguous(), [cut], [cut], own_table, caches, device)
        tail = _prefill(own_q[cut:].contiguous(), [prompt - cut], [prompt], own_table, caches, device)
        assert torch.equal(torch.cat([head, tail]), alone), "a row changed with the chunk it was computed in"


@st.composite
def linear_problem(draw: st.DrawFn) -> tuple[int, int, int, bool, int]:
    m = draw(st.integers(1, 40))
    n = draw(st.integers(0, 35)) * 2 + 1  # odd: a partial column tile
    k = draw(st.integers(0, 35)) * 2 + 1  # odd: a partial K chunk
    return m, n, k, draw(st.booleans()), draw(st.integers(0, 2**16))


def _layer(m: int, n: int, k: int, bias: bool, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if bias else None
    return tuple(t.to(dtype) for t in (x, w, *([b] if b is not None else [])))


@pytest.mark.clause("KERN-29")
@settings(max_examples=10, deadline=None)
@given(problem=linear_problem(), dtype=st.sampled_from(DTYPES))
@example(problem=(37, 33, 35, True, 1), dtype=torch.float32)  # two row tiles, two column tiles, two K chunks
def test_triton_linear_row_alone_equals_its_row_in_any_batch(
    problem: tuple[int, int, int, bool, int], dtype: torch.dtype, device: torch.device
) -> None:
    """KERN-29: each row of the Triton linear is bit for bit the same alone, in the whole batch and in any slice of
    it, for M in 1..40 and odd N and K (partial tiles and chunks)."""
    m, n, k, bias, seed = problem
    x, w, *b = (t.to(device) for t in _layer(m, n, k, bias, seed, dtype))
    layer = triton_linear.TritonBoundLinear(w, b[0] if b else None)
    whole = layer(x)
    assert whole.shape == (m, n) and whole.dtype == dtype and not whole.isnan().any()
    for i in range(m):
        assert torch.equal(layer(x[i : i + 1])[0], whole[i]), f"row {i} of {m} differs alone"
    a = seed % m
    assert torch.equal(layer(x[a:]), whole[a:]), f"the slice from row {a} differs"
    assert torch.equal(triton_linear.linear(x.unsqueeze(0), w, b[0] if b else None)[0], whole)


@pytest.mark.clause("KERN-29")
@settings(max_examples=8, deadline=None)
@given(problem=linear_problem())
@example(problem=(3, 5, 1, True, 0))  # one product per output
def test_triton_linear_is_within_the_float32_bound_of_the_float64_product(
    problem: tuple[int, int, int, bool, int], device: torch.device
) -> None:
    """KERN-29: |y - y64| <= (K + 1) * 2^-24 * (|x| @ |w|^T + |b|) elementwise, y64 the float64 product of the same
    float32 inputs: the bound of any order of K float32 roundings and the bias's add."""
    m, n, k, bias, seed = problem
    x, w, *b = _layer(m, n, k, bias, seed, torch.float32)
    y = triton_linear.linear(x.to(device), w.to(device), b[0].to(device) if b else None).cpu().double()
    exact = x.double() @ w.double().T + (b[0].double() if b else 0.0)
    scale = x.double().abs() @ w.double().abs().T + (b[0].double().abs() if b else 0.0)
    assert bool(((y - exact).abs() <= (k + 1) * 2.0**-24 * scale).all()), ((y - exact).abs() / scale).max()


@pytest.mark.clause("KERN-29")
@settings(max_examples=6, deadline=None)
@given(problem=linear_problem(), dtype=st.sampled_from([torch.float16, torch.bfloat16]))
@example(problem=(5, 33, 71, True, 0), dtype=torch.bfloat16)
def test_triton_linear_rounds_a_16_bit_output_to_nearest_once(
    problem: tuple[int, int, int, bool, int], dtype: torch.dtype, device: torch.device
) -> None:
    """KERN-29: a float16 or bfloat16 output is its float32 sum rounded to nearest: within the float32 bound (doubled,
    as a device's tensor cores need not round to nearest while they accumulate) plus half an ulp of the dtype of the
    float64 product of the same inputs. A truncating cast (the interpreter's bfloat16) is up to a whole ulp off."""
    m, n, k, bias, seed = problem
    x, w, *b = _layer(m, n, k, bias, seed, dtype)
    y = triton_linear.linear(x.to(device), w.to(device), b[0].to(device) if b else None).cpu().double()
    exact = x.double() @ w.double().T + (b[0].double() if b else 0.0)
    scale = x.double().abs() @ w.double().abs().T + (b[0].double().abs() if b else 0.0)
    sum_error = 2 * (k + 1) * 2.0**-24 * scale
    info = torch.finfo(dtype)
    half_ulp = info.eps / 2  # of |v| for a normal v; below the normals, of the smallest normal
    bound = sum_error + half_ulp * (exact.abs() + sum_error) + half_ulp * info.smallest_normal
    assert bool(((y - exact).abs() <= bound).all()), ((y - exact).abs() / bound).max()


@pytest.mark.clause("KERN-29")
def test_triton_linear_refuses_what_is_not_a_layer(device: torch.device) -> None:
    """KERN-29: a weight or bias of another dtype or shape, or an input that does not fit, is a ValueError naming
    the tensor; in_features 0 gives the bias (zeros without one)."""
    w = torch.randn(3, 4).to(device)
    with pytest.raises(ValueError, match="weight"):
        triton_linear.TritonBoundLinear(w.double())
    with pytest.raises(ValueError, match="weight"):
        triton_linear.TritonBoundLinear(w[0])
    with pytest.raises(ValueError, match="bias"):
        triton_linear.TritonBoundLinear(w, torch.zeros(4).to(device))
    with pytest.raises(ValueError, match="x "):
        triton_linear.linear(torch.randn(2, 5).to(device), w)
    empty = triton_linear.linear(torch.randn(2, 0).to(device), torch.randn(3, 0).to(device), torch.ones(3).to(device))
    assert torch.equal(empty.cpu(), torch.ones(2, 3))


@pytest.mark.clause("KERN-28")
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_norm_and_rotary_rows_alone_equal_their_rows_in_a_batch(
    dtype: torch.dtype, device: torch.device
) -> None:
    """KERN-28: one program per row (and head), blocks sized by the hidden size or head dim alone: the fused
    add-norm and the rotary give a row the same bits alone as in a batch of 37."""
    from kernels import rotary, triton_norm, triton_rotary

    gen = torch.Generator().manual_seed(7)
    rows, hidden, heads, dim = 37, 24, 3, 8
    x = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
    weight = torch.randn(hidden, generator=gen).to(dtype).to(device)
    normed, summed = triton_norm.add_rms_norm(x, residual, weight, 1e-6)
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype).to(device)
    k = torch.randn(rows, 1, dim, generator=gen).to(dtype).to(device)
    positions = torch.randint(0, 64, (rows,), generator=gen).to(device)
    cos_sin = rotary.rotary_cos_sin(dim, 64, 10000.0, dtype, device)
    q_rot, k_rot = triton_rotary.apply_rotary(q, k, positions, cos_sin)
    for i in (0, 17, rows - 1):
        one = slice(i, i + 1)
        alone_normed, alone_summed = triton_norm.add_rms_norm(x[one], residual[one], weight, 1e-6)
        assert torch.equal(alone_normed[0], normed[i]) and torch.equal(alone_summed[0], summed[i])
        alone_q, alone_k = triton_rotary.apply_rotary(q[one], k[one], positions[one], cos_sin)
        assert torch.equal(alone_q[0], q_rot[i]) and torch.equal(alone_k[0], k_rot[i])
