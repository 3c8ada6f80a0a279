"""The compiled CPU decode and prefill (kernels/cpu_attention.c) against the torch oracle, their build cache and
backend, and the engine's use of them.

Caches are random (never zeros), each row owns a random, scattered set of blocks, unused blocks and the slots past
a context hold random garbage, and tables carry extra -1 columns, so a kernel that reads a slot it should not,
or misses one it should, moves the result. Shapes cover GQA ratios 1, 3 and 8, the head dims the kernel
specialises (64, 128) and others (a tail shorter than its 16 partial sums), block sizes 1 to 16, and contexts of 0,
1, exactly a block boundary and the whole table width.
"""

from __future__ import annotations

import decimal
import math
import os
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels import cpu_attention, cpu_build, paged_attention
from kernels.backend import get_backend
from optimized import SamplingParams
from optimized.engine.model_runner import DrawParams, ScheduledSeq
from tests.engine_fixtures import VOCAB, checkpoint, hf_greedy, make_llm

CPU = torch.device("cpu")
# float32: the C kernels sum each dot product in their own order and torch's GEMM in its, so scores of magnitude ~10
# differ by an ulp or two (~1e-6) before the exponential; the largest difference measured over these shapes with 15
# seeds each is 1.6e-6 for decode and 2.2e-6 for prefill (relative to 1 + |expected|).
F32_TOL = 5e-6
# float64: the C kernels compute the softmax in double; the torch oracle rounds its softmax to float32 (the eager
# contract, KERN-3), so the two agree to float32 rounding only, and the kernels to double rounding (measured 9e-15)
# with an all-double reference.
F64_TOL_ORACLE = 1e-6
F64_TOL_DOUBLE = 1e-12


@pytest.fixture(autouse=True)
def _kernel_available() -> None:
    # Only a machine without a C compiler may skip: with one, a kernel that fails to build is a failure here, not a
    # silent fall back to torch (KERN-24).
    if cpu_build.find_compiler() is None:
        pytest.skip("no C compiler on the PATH")
    reason = cpu_build.unavailable_reason()
    assert reason is None, f"the C kernel did not build: {reason}"


@dataclass
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor


def make_case(
    lens: list[int], block_size: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int
) -> Case:
    """Rows of the given context lengths over scattered blocks; the table is one column wider than the longest
    row needs, and q is a strided view of a packed q|k projection (as the model hands it)."""
    gen = torch.Generator().manual_seed(seed)
    per_row = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_row) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen, dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(lens), max(per_row) + 1), -1, dtype=torch.int32)
    for row, count in enumerate(per_row):
        tables[row, :count] = torch.tensor([order.pop() for _ in range(count)], dtype=torch.int32)
    packed = torch.randn(len(lens), heads + kv_heads, dim, generator=gen, dtype=dtype)
    return Case(packed[:, :heads], k_cache, v_cache, torch.tensor(lens, dtype=torch.int32), tables)


def double_decode(c: Case, scale: float) -> torch.Tensor:
    """Decode attention entirely in float64, one row at a time (softmax in double too)."""
    batch, heads, dim = c.q.shape
    block_size, kv_heads = c.k_cache.shape[1], c.k_cache.shape[2]
    out = torch.zeros(batch, heads, dim, dtype=torch.float64)
    for b, n in enumerate(c.context_lens.tolist()):
        if n == 0:
            continue
        blocks = c.block_tables[b, : -(-n // block_size)].long()
        k = c.k_cache[blocks].reshape(-1, kv_heads, dim)[:n].double()
        v = c.v_cache[blocks].reshape(-1, kv_heads, dim)[:n].double()
        for h in range(heads):
            j = h // (heads // kv_heads)
            weights = torch.softmax(k[:, j] @ c.q[b, h].double() * scale, dim=0)
            out[b, h] = weights @ v[:, j]
    return out


Tensors5 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def decode_args(c: Case) -> Tensors5:
    return c.q, c.k_cache, c.v_cache, c.context_lens, c.block_tables


# (block size, heads, kv heads, head dim): GQA 1, 3 and 8; specialised dims 64 and 128; generic dims with a tail.
SHAPES = [(1, 4, 4, 64), (2, 6, 2, 12), (3, 8, 1, 24), (5, 4, 2, 128), (8, 3, 1, 20), (16, 4, 2, 64)]


def lens_for(block_size: int) -> list[int]:
    """Context 0, 1, exactly two blocks, a ragged one and the longest (which fills its table row but for the
    extra -1 column; the row of exactly the whole width is checked apart)."""
    return [0, 1, 2 * block_size, 3 * block_size + 1, 5 * block_size]


@pytest.mark.clause("KERN-22", "KERN-23")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("block_size", "heads", "kv_heads", "dim"), SHAPES)
def test_c_decode_equals_torch_decode(block_size: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> None:
    """KERN-22, KERN-23: the C decode equals the torch paged_decode (float32: within F32_TOL; float64: within the
    oracle's float32 softmax, and within 1e-12 of an all-double reference); context 0 gives exact zeros."""
    case = make_case(lens_for(block_size), block_size, heads, kv_heads, dim, dtype, seed=block_size * 7 + dim)
    assert not case.q.is_contiguous()  # the kernel reads the strided view in place
    out = cpu_attention.paged_decode(*decode_args(case), 0.3)
    expected = paged_attention.paged_decode(*decode_args(case), 0.3)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=F32_TOL, atol=F32_TOL)
    else:
        torch.testing.assert_close(out, expected, rtol=F64_TOL_ORACLE, atol=F64_TOL_ORACLE)
        torch.testing.assert_close(out, double_decode(case, 0.3), rtol=F64_TOL_DOUBLE, atol=F64_TOL_DOUBLE)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.clause("KERN-22")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_c_decode_reads_a_whole_table_row_and_only_the_context(dtype: torch.dtype) -> None:
    """KERN-22: a context exactly as long as the table is wide; garbage past a context (in its last block, in
    blocks it does not own, behind -1 entries) never reaches the output."""
    case = make_case([12, 7, 4], 4, 4, 2, 64, dtype, seed=11)
    tables = case.block_tables[:, :3].contiguous()  # row 0's 12 tokens fill all 3 columns
    trimmed = Case(case.q, case.k_cache, case.v_cache, case.context_lens, tables)
    out = cpu_attention.paged_decode(*decode_args(trimmed), 0.2)
    torch.testing.assert_close(out, double_decode(trimmed, 0.2).to(dtype), rtol=F32_TOL, atol=F32_TOL)
    poked_k, poked_v = case.k_cache.clone(), case.v_cache.clone()
    used = {int(b) for b in tables.flatten() if b >= 0}
    for block in set(range(case.k_cache.shape[0])) - used:
        poked_k[block], poked_v[block] = 1e4, -1e4
    last = int(tables[1, 1])  # row 1 holds 7 tokens: slots 3.. of its second block are past its context
    poked_k[last, 3:], poked_v[last, 3:] = 1e4, -1e4
    poked = Case(case.q, poked_k, poked_v, case.context_lens, tables)
    assert torch.equal(cpu_attention.paged_decode(*decode_args(poked), 0.2), out)


def double_prefill(c: Case, qlens: list[int], scale: float) -> torch.Tensor:
    """Causal prefill attention entirely in float64: sequence b's queries are its last qlens[b] positions."""
    rows, heads, dim = c.q.shape
    block_size, kv_heads = c.k_cache.shape[1], c.k_cache.shape[2]
    out = torch.zeros(rows, heads, dim, dtype=torch.float64)
    first = 0
    for b, (n, qlen) in enumerate(zip(c.context_lens.tolist(), qlens, strict=True)):
        blocks = c.block_tables[b, : -(-n // block_size)].long()
        k = c.k_cache[blocks].reshape(-1, kv_heads, dim)[:n].double()
        v = c.v_cache[blocks].reshape(-1, kv_heads, dim)[:n].double()
        for i in range(qlen):
            seen = n - qlen + i + 1
            for h in range(heads):
                j = h // (heads // kv_heads)
                weights = torch.softmax(k[:seen, j] @ c.q[first + i, h].double() * scale, dim=0)
                out[first + i, h] = weights @ v[:seen, j]
        first += qlen
    return out


def prefill_case(
    lens: list[int], qlens: list[int], block_size: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> tuple[Case, torch.Tensor]:
    """A case whose q holds the packed queries (a strided view) and the matching cu_seqlens_q."""
    case = make_case(lens, block_size, heads, kv_heads, dim, dtype, seed=sum(lens) + dim)
    packed = torch.randn(sum(qlens), heads + kv_heads, dim, generator=torch.Generator().manual_seed(1), dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    return Case(packed[:, :heads], case.k_cache, case.v_cache, case.context_lens, case.block_tables), cu


Tensors6 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def prefill_args(c: Case, cu: torch.Tensor) -> Tensors6:
    return c.q, c.k_cache, c.v_cache, cu, c.context_lens, c.block_tables


# (context lens, query lens, block size, heads, kv heads, head dim): whole prompts, chunks and prefix-cache tails
# (qlen < context), a sequence without queries, one query (a decode-like tail), more queries than one score tile,
# block sizes 1..16, GQA 1, 3 and 8, the specialised dims 64 and 128 and generic ones.
PREFILL_SHAPES = [
    ([7, 1, 23], [7, 1, 23], 5, 6, 2, 12),
    ([9, 17, 4], [2, 17, 0], 3, 4, 4, 8),
    ([33, 16], [5, 16], 4, 8, 1, 20),
    ([40], [13], 1, 3, 1, 24),
    ([70, 32, 19], [70, 1, 19], 16, 4, 2, 64),
    ([38, 21], [38, 9], 2, 4, 2, 128),
]


@pytest.mark.clause("KERN-27", "KERN-23")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("lens", "qlens", "block_size", "heads", "kv_heads", "dim"), PREFILL_SHAPES)
def test_c_prefill_equals_torch_prefill(
    lens: list[int], qlens: list[int], block_size: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> None:
    """KERN-27, KERN-23: the C prefill equals the torch paged_prefill (float32 within F32_TOL; float64 within the
    oracle's float32 softmax and within 1e-12 of an all-double reference), queries being the last positions."""
    case, cu = prefill_case(lens, qlens, block_size, heads, kv_heads, dim, dtype)
    out = cpu_attention.paged_prefill(*prefill_args(case, cu), 0.3)
    expected = paged_attention.paged_prefill(*prefill_args(case, cu), 0.3)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=F32_TOL, atol=F32_TOL)
    else:
        torch.testing.assert_close(out, expected, rtol=F64_TOL_ORACLE, atol=F64_TOL_ORACLE)
        torch.testing.assert_close(out, double_prefill(case, qlens, 0.3), rtol=F64_TOL_DOUBLE, atol=F64_TOL_DOUBLE)


@pytest.mark.clause("KERN-23")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_nan_stays_in_its_own_rows(dtype: torch.dtype) -> None:
    """KERN-23: NaN stays NaN, as in torch's softmax: a NaN in a query makes that query's head NaN, and a NaN in a
    cached key (past the first, so the maximum does not start from it) makes NaN every head of its KV head whose
    query sees that key; every other output is bit for bit the NaN-free one, decode and prefill alike."""
    case = make_case([6, 9, 3], 4, 4, 2, 16, dtype, seed=12)
    pcase, cu = prefill_case([6, 9], [2, 9], 4, 4, 2, 16, dtype)
    clean = (
        cpu_attention.paged_decode(*decode_args(case), 0.3),
        cpu_attention.paged_prefill(*prefill_args(pcase, cu), 0.3),
    )
    nan_q, nan_pq = case.q.clone(), pcase.q.clone()
    nan_q[1, 2, 5] = nan_pq[4, 3, 0] = float("nan")
    nan_k = case.k_cache.clone()
    nan_k[int(case.block_tables[1, 0]), 1, 0, 7] = float("nan")  # row 1's second token, KV head 0
    nan_pk = pcase.k_cache.clone()
    nan_pk[int(pcase.block_tables[1, 1]), 2, 1, 3] = float("nan")  # sequence 1's token 6, KV head 1
    runs = (
        (clean[0], cpu_attention.paged_decode(nan_q, *decode_args(case)[1:], 0.3), [(1, 2)]),
        (clean[1], cpu_attention.paged_prefill(nan_pq, *prefill_args(pcase, cu)[1:], 0.3), [(4, 3)]),
        (
            clean[0],
            cpu_attention.paged_decode(case.q, nan_k, *decode_args(case)[2:], 0.3),
            [(1, 0), (1, 1)],
        ),
        (
            clean[1],
            cpu_attention.paged_prefill(pcase.q, nan_pk, *prefill_args(pcase, cu)[2:], 0.3),
            [(row, head) for row in range(2, 11) if row - 2 >= 6 for head in (2, 3)],  # queries at positions >= 6
        ),
    )
    for expected, out, poisoned in runs:
        rows, heads = zip(*poisoned, strict=True)
        assert bool(out[list(rows), list(heads)].isnan().all())
        mask = torch.ones(out.shape[:2], dtype=torch.bool)
        mask[list(rows), list(heads)] = False
        assert torch.equal(out[mask], expected[mask])


def kernel_exp(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The C kernels' own exponential of each ``x`` (x <= -17 for float32, <= -37 for float64), read through one
    decode row (or one prefill sequence) per value: two keys scoring x and 0 exactly (q = x e0, keys e0 and 0, scale
    1), so the softmax's sum 1 + e^x rounds to exactly 1 (checked: the second key's weight is 1, or NaN for a NaN
    x) and the first key's weight, which V = e0 copies to output lane 0, is the kernel's e^x, not rounded again."""
    n, dtype = x.shape[0], x.dtype
    q = torch.zeros(n, 1, 16, dtype=dtype)
    q[:, 0, 0] = x
    k_cache = torch.zeros(1, 2, 1, 16, dtype=dtype)
    v_cache = torch.zeros(1, 2, 1, 16, dtype=dtype)
    k_cache[0, 0, 0, 0] = v_cache[0, 0, 0, 0] = v_cache[0, 1, 0, 1] = 1
    lens, tables = torch.full((n,), 2, dtype=torch.int32), torch.zeros(n, 1, dtype=torch.int32)
    if kind == "decode":
        out = cpu_attention.paged_decode(q, k_cache, v_cache, lens, tables, 1.0)
    else:
        cu = torch.arange(n + 1, dtype=torch.int32)
        out = cpu_attention.paged_prefill(q, k_cache, v_cache, cu, lens, tables, 1.0)
    assert bool(((out[:, 0, 1] == 1) | x.isnan()).all())
    return out[:, 0, 0]


def ulps_from_exact_exp(got: float, x: float, mantissa_bits: int) -> float:
    """|got - e^x| in units in the last place of e^x, e^x computed in 40 decimal digits."""
    decimal.getcontext().prec = 40
    exact = decimal.Decimal(x).exp()
    ulp = decimal.Decimal(2) ** (math.frexp(float(exact))[1] - 1 - mantissa_bits)
    return float(abs(decimal.Decimal(got) - exact) / ulp)


@pytest.mark.clause("KERN-23")
@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize(("dtype", "low", "high", "mantissa_bits"), [
    (torch.float32, -87.0, -17.0, 23),
    (torch.float64, -708.0, -37.0, 52),
])  # fmt: skip
def test_the_kernels_exponential_is_within_its_stated_ulps(
    kind: str, dtype: torch.dtype, low: float, high: float, mantissa_bits: int
) -> None:
    """KERN-23: the kernels' exponential is within 1.3 ulp of the exact value, measured through the kernel over
    [-87, -17] (float32) and [-708, -37] (float64): every reduced argument r in [-ln2/2, ln2/2] and the largest
    multiples k of ln 2, whose two-part range reduction errs most. Below -87 (float32) or -708 (float64) it is 0,
    which flushes e^-87.2 although that is above FLT_MIN (and e^-708.2 above DBL_MIN); NaN stays NaN."""
    x = torch.rand(256, generator=torch.Generator().manual_seed(23), dtype=torch.float64) * (high - low) + low
    x = torch.cat([x, torch.tensor([low, high], dtype=torch.float64)]).to(dtype)
    got = kernel_exp(x, kind)
    worst = max(ulps_from_exact_exp(g, v, mantissa_bits) for g, v in zip(got.tolist(), x.tolist(), strict=True))
    assert worst <= 1.3
    tiny = torch.finfo(dtype).tiny
    below = torch.tensor([low, low - 0.2, -1e4], dtype=dtype)
    below[0] = torch.nextafter(below[0], below[2])  # the first value of dtype under the cut
    assert math.exp(low - 0.2) > tiny and bool((kernel_exp(below, kind) == 0).all())
    assert math.isnan(float(kernel_exp(torch.tensor([math.nan], dtype=dtype), kind)[0]))


@pytest.mark.clause("KERN-27")
def test_c_prefill_refuses_queries_its_context_cannot_hold() -> None:
    """KERN-27: more queries than context tokens, cu_seqlens_q not starting at 0 or not ending at q's rows, or a
    table that does not hold a context, is a ValueError, nothing read out of bounds."""
    case, cu = prefill_case([6, 9], [6, 9], 4, 4, 2, 16, torch.float32)
    too_many = case.context_lens.clone()
    too_many[1] = 8  # 9 queries over 8 tokens
    with pytest.raises(ValueError, match="sequence 1: 9 queries over a context of 8"):
        cpu_attention.paged_prefill(case.q, case.k_cache, case.v_cache, cu, too_many, case.block_tables, 0.3)
    with pytest.raises(ValueError, match="sequence 0"):
        cpu_attention.paged_prefill(
            case.q[1:], case.k_cache, case.v_cache, cu - 1, case.context_lens, case.block_tables, 0.3
        )
    with pytest.raises(ValueError, match="ends at 15, but q has 14 rows"):
        cpu_attention.paged_prefill(
            case.q[1:], case.k_cache, case.v_cache, cu, case.context_lens, case.block_tables, 0.3
        )
    tables = case.block_tables.clone()
    tables[1, 2] = -1
    with pytest.raises(ValueError, match="sequence 1"):
        cpu_attention.paged_prefill(case.q, case.k_cache, case.v_cache, cu, case.context_lens, tables, 0.3)


@pytest.mark.clause("KERN-22")
def test_c_decode_refuses_a_table_that_does_not_hold_the_context() -> None:
    """KERN-22: a -1 or an out-of-range block inside a context, or a context longer than the table, is a
    ValueError naming the row, never an out-of-bounds read."""
    case = make_case([5, 9], 4, 4, 2, 16, torch.float32, seed=3)
    num_blocks = case.k_cache.shape[0]
    for row, column, value in ((1, 2, -1), (0, 1, num_blocks), (1, 0, -7)):
        tables = case.block_tables.clone()
        tables[row, column] = value
        with pytest.raises(ValueError, match=f"row {row}"):
            cpu_attention.paged_decode(case.q, case.k_cache, case.v_cache, case.context_lens, tables, 0.3)
    too_long = case.context_lens.clone()
    too_long[1] = 4 * case.block_tables.shape[1] + 1
    with pytest.raises(ValueError, match="row 1"):
        cpu_attention.paged_decode(case.q, case.k_cache, case.v_cache, too_long, case.block_tables, 0.3)


@pytest.mark.clause("KERN-22", "KERN-27")
def test_c_kernels_refuse_tables_that_do_not_convert_to_int32_exactly() -> None:
    """KERN-22, KERN-27: tables, lengths and query offsets hold integers that fit int32; a wider value (a block id
    2**32 + 3 that int32 would read as block 3, a length 2**32 + 6 read as 6) or a float or bool tensor is a
    ValueError naming the tensor, never silently truncated. Integer dtypes whose values fit compute as int32."""
    case = make_case([6, 9], 4, 4, 2, 16, torch.float32, seed=3)
    expected = cpu_attention.paged_decode(*decode_args(case), 0.3)
    for dtype in (torch.int64, torch.int16):
        lens, tables = case.context_lens.to(dtype), case.block_tables.to(dtype)
        assert torch.equal(cpu_attention.paged_decode(case.q, case.k_cache, case.v_cache, lens, tables, 0.3), expected)
    wide = case.block_tables.long()
    for value in (2**32 + int(wide[0, 0]), int(wide[0, 0]) - 2**32):
        wide[0, 0] = value
        with pytest.raises(ValueError, match=f"^block_tables row 0 holds {value}"):
            cpu_attention.paged_decode(case.q, case.k_cache, case.v_cache, case.context_lens, wide, 0.3)
    long_lens = case.context_lens.long() + torch.tensor([0, 2**32])
    with pytest.raises(ValueError, match=f"^context_lens row 1 holds {2**32 + 9}"):
        cpu_attention.paged_decode(case.q, case.k_cache, case.v_cache, long_lens, case.block_tables, 0.3)
    for name, bad in (("context_lens", case.context_lens.float()), ("block_tables", case.block_tables.double())):
        args: dict[str, Any] = {"context_lens": case.context_lens, "block_tables": case.block_tables, name: bad}
        with pytest.raises(ValueError, match=rf"^{name} is torch\.float"):
            cpu_attention.paged_decode(case.q, case.k_cache, case.v_cache, **args, scale=0.3)
    with pytest.raises(ValueError, match=r"^block_tables is torch\.bool"):
        cpu_attention.paged_decode(case.q, case.k_cache, case.v_cache, case.context_lens, wide > 0, 0.3)
    pcase, cu = prefill_case([6, 9], [2, 9], 4, 4, 2, 16, torch.float32)
    prefill_expected = cpu_attention.paged_prefill(*prefill_args(pcase, cu), 0.3)
    assert torch.equal(cpu_attention.paged_prefill(*prefill_args(pcase, cu.long()), 0.3), prefill_expected)
    wide_cu = cu.long() + torch.tensor([0, 2**32, 0])  # truncated, [0, 2, 11] would pass every later check
    with pytest.raises(ValueError, match=f"^cu_seqlens_q row 1 holds {2**32 + 2}"):
        cpu_attention.paged_prefill(*prefill_args(pcase, wide_cu), 0.3)
    with pytest.raises(ValueError, match=r"^cu_seqlens_q is torch\.float32"):
        cpu_attention.paged_prefill(*prefill_args(pcase, cu.float()), 0.3)


@pytest.mark.clause("KERN-22", "KERN-27")
def test_c_kernels_refuse_malformed_shapes_by_name() -> None:
    """KERN-22, KERN-27: caches that are not [num_blocks, block_size, kv_heads >= 1, head_dim] alike, a head count
    that is not a multiple of the KV heads, or lengths, offsets and tables that do not describe q's batch, are a
    ValueError naming the tensor at fault (never a division by zero or an unpacking error), before any C runs."""
    case = make_case([6, 9], 4, 4, 2, 16, torch.float32, seed=3)
    q, k, v, lens, tables = decode_args(case)
    no_heads = torch.zeros(k.shape[0], 4, 0, 16)
    not_4d = r"k_cache \(\d+, 4, 16\) is not \[num_blocks, block_size, kv_heads, head_dim\]"
    bad_caches = (
        (no_heads, no_heads, "k_cache has 0 KV heads"),
        (k[:, :, 0].contiguous(), v[:, :, 0].contiguous(), not_4d),
        (k, v[:, :2].contiguous(), "v_cache"),
        (k[..., :8].contiguous(), v[..., :8].contiguous(), "k_cache head_dim 8 is not q's 16"),
    )
    pcase, cu = prefill_case([6, 9], [2, 9], 4, 4, 2, 16, torch.float32)
    for k_bad, v_bad, message in bad_caches:
        with pytest.raises(ValueError, match=f"^{message}"):
            cpu_attention.paged_decode(q, k_bad, v_bad, lens, tables, 0.3)
        with pytest.raises(ValueError, match=f"^{message}"):
            cpu_attention.paged_prefill(pcase.q, k_bad, v_bad, cu, pcase.context_lens, pcase.block_tables, 0.3)
    with pytest.raises(ValueError, match=r"^q has 3 heads, not a multiple of the caches' 2 KV heads"):
        cpu_attention.paged_decode(q[:, :3], k, v, lens, tables, 0.3)
    for bad_lens, bad_tables, name in (
        (lens[0], tables, "context_lens"),
        (lens[:1], tables, "context_lens"),
        (lens, tables[0], "block_tables"),
        (lens, tables[:1], "block_tables"),
    ):
        with pytest.raises(ValueError, match=f"^{name}"):
            cpu_attention.paged_decode(q, k, v, bad_lens, bad_tables, 0.3)
    plens, ptables = pcase.context_lens, pcase.block_tables
    for bad_cu, bad_lens, bad_tables, name in (
        (cu, plens[0], ptables, "context_lens"),
        (cu[:2], plens, ptables, "cu_seqlens_q"),
        (cu[None], plens, ptables, "cu_seqlens_q"),
        (cu, plens, ptables[0], "block_tables"),
        (cu, plens, ptables[:1], "block_tables"),
    ):
        with pytest.raises(ValueError, match=f"^{name}"):
            cpu_attention.paged_prefill(pcase.q, k, v, bad_cu, bad_lens, bad_tables, 0.3)


@pytest.mark.clause("KERN-22", "KERN-27")
def test_c_kernels_take_cpu_tensors_only_and_answer_on_qs_device() -> None:
    """KERN-22, KERN-27: every tensor the C kernels read is a CPU tensor, or a ValueError names it before any C
    runs (a pointer into another device's memory would crash the process); the output is allocated on q's device,
    whatever torch's default device is."""
    case, cu = prefill_case([6, 9], [2, 9], 4, 4, 2, 16, torch.float32)
    decode_case = make_case([6, 9], 4, 4, 2, 16, torch.float32, seed=3)
    meta = torch.device("meta")
    decode_names = ("q", "k_cache", "v_cache", "context_lens", "block_tables")
    for name, tensor in zip(decode_names, decode_args(decode_case), strict=True):
        moved: dict[str, Any] = {
            **dict(zip(decode_names, decode_args(decode_case), strict=True)),
            name: tensor.to(meta),
        }
        with pytest.raises(ValueError, match=f"^{name} is on meta"):
            cpu_attention.paged_decode(**moved, scale=0.3)
    prefill_names = ("q", "k_cache", "v_cache", "cu_seqlens_q", "context_lens", "block_tables")
    for name, tensor in zip(prefill_names, prefill_args(case, cu), strict=True):
        moved = {**dict(zip(prefill_names, prefill_args(case, cu), strict=True)), name: tensor.to(meta)}
        with pytest.raises(ValueError, match=f"^{name} is on meta"):
            cpu_attention.paged_prefill(**moved, scale=0.3)
    expected = (
        cpu_attention.paged_decode(*decode_args(decode_case), 0.3),
        cpu_attention.paged_prefill(*prefill_args(case, cu), 0.3),
    )
    default = torch.get_default_device()
    torch.set_default_device(meta)
    try:
        got = (
            cpu_attention.paged_decode(*decode_args(decode_case), 0.3),
            cpu_attention.paged_prefill(*prefill_args(case, cu), 0.3),
        )
    finally:
        torch.set_default_device(default)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.clause("KERN-26")
def test_c_decode_is_the_same_on_any_thread_count() -> None:
    """KERN-26: each row (or each KV head, when rows are fewer than threads) is computed by one thread in a fixed
    order, so 1 and 2 threads give bit-identical results, for a decode batch, a single row and a prefill."""
    case = make_case([40, 3, 0, 17, 33, 8], 4, 8, 2, 64, torch.float32, seed=5)
    single = Case(case.q[:1], case.k_cache, case.v_cache, case.context_lens[:1], case.block_tables[:1])
    prefill, cu = prefill_case([40, 3, 17], [11, 3, 17], 4, 8, 2, 64, torch.float32)
    before = torch.get_num_threads()
    results: dict[tuple[int, str], torch.Tensor] = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results[threads, "batch"] = cpu_attention.paged_decode(*decode_args(case), 0.3)
            results[threads, "row"] = cpu_attention.paged_decode(*decode_args(single), 0.3)
            results[threads, "prefill"] = cpu_attention.paged_prefill(*prefill_args(prefill, cu), 0.3)
    finally:
        torch.set_num_threads(before)
    for kind in ("batch", "row", "prefill"):
        assert torch.equal(results[1, kind], results[2, kind]), kind
    assert torch.equal(results[1, "row"], results[1, "batch"][:1])


@pytest.mark.clause("KERN-24")
def test_cpu_backend_uses_the_c_decode_for_float_and_torch_for_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """KERN-24: get_backend(None, cpu) is the "cpu" backend here; it decodes and prefills float32/float64 with the
    C kernels and other dtypes with the torch ones; its store is the torch backend's."""
    backend = get_backend(None, CPU)
    assert backend.name == "cpu" and get_backend("cpu", CPU).name == "cpu"
    calls: list[tuple[str, torch.dtype]] = []
    real_decode, real_prefill = cpu_attention.paged_decode, cpu_attention.paged_prefill

    def counting_decode(q: torch.Tensor, *rest: Any) -> torch.Tensor:
        calls.append(("decode", q.dtype))
        return real_decode(q, *rest)

    def counting_prefill(q: torch.Tensor, *rest: Any) -> torch.Tensor:
        calls.append(("prefill", q.dtype))
        return real_prefill(q, *rest)

    monkeypatch.setattr(cpu_attention, "paged_decode", counting_decode)
    monkeypatch.setattr(cpu_attention, "paged_prefill", counting_prefill)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        case = make_case([6, 0, 9], 4, 4, 2, 16, dtype, seed=8)
        out = backend.decode(*decode_args(case), 0.3)
        expected = paged_attention.paged_decode(*decode_args(case), 0.3)
        pcase, cu = prefill_case([6, 9], [2, 9], 4, 4, 2, 16, dtype)
        prefilled = backend.prefill(*prefill_args(pcase, cu), 0.3)
        prefill_expected = paged_attention.paged_prefill(*prefill_args(pcase, cu), 0.3)
        if dtype == torch.bfloat16:
            assert torch.equal(out, expected) and torch.equal(prefilled, prefill_expected)
        else:
            torch.testing.assert_close(out, expected, rtol=F32_TOL, atol=F32_TOL)
            torch.testing.assert_close(prefilled, prefill_expected, rtol=F32_TOL, atol=F32_TOL)
    assert calls == [(kind, t) for t in (torch.float32, torch.float64) for kind in ("decode", "prefill")]
    case = make_case([6, 9], 4, 4, 2, 16, torch.float32, seed=9)
    k, v = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    slots = torch.tensor([int(case.block_tables[0, 1]) * 4 + 1, -1])
    stored = (case.k_cache.clone(), case.v_cache.clone())
    backend.store_kv(k, v, *stored, slots)
    paged_attention.store_kv(k, v, case.k_cache, case.v_cache, slots)
    assert torch.equal(stored[0], case.k_cache) and torch.equal(stored[1], case.v_cache)


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty kernel cache folder and a process that has not loaded the kernel yet; afterwards the remembered
    outcome is dropped again, so later tests load from the usual folder."""
    monkeypatch.setenv("NANOVERIFY_CACHE", str(tmp_path))
    cpu_build.forget()
    yield tmp_path / "kernels"
    cpu_build.forget()


@pytest.mark.clause("KERN-25", "DISK-1")
def test_build_goes_to_the_cache_once_and_is_reused(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """KERN-25, DISK-1: the library is built into <cache root>/kernels under a name keyed by source, compiler, flags
    and machine, beside its checksum and its lock file, with no temporary file left; a later load reuses it without
    running the compiler; a different machine or different flags get a different name."""
    compiler = cpu_build.find_compiler()
    assert compiler is not None
    target = cpu_build.library_path(compiler)
    assert target.parent == fresh_cache and not target.exists()
    cpu_build.load_library()
    sidecar = cpu_build.sidecar_path(target)
    assert sorted(p.name for p in fresh_cache.iterdir()) == sorted([target.name, sidecar.name, f".{target.name}.lock"])

    def no_compiler(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the compiler ran although the library was cached")

    monkeypatch.setattr(cpu_build, "build", no_compiler)
    cpu_build.forget()
    library = cpu_build.load_library()
    assert hasattr(library, "nv_paged_decode_f32") and hasattr(library, "nv_paged_decode_f64")
    machine_id = cpu_build.machine_id
    monkeypatch.setattr(cpu_build, "machine_id", lambda: "another CPU")
    assert cpu_build.library_path(compiler) != target
    monkeypatch.setattr(cpu_build, "machine_id", machine_id)
    monkeypatch.setattr(cpu_build, "FLAGS", (*cpu_build.FLAGS, "-DNV_OTHER"))
    assert cpu_build.library_path(compiler) != target


def mapped_files() -> set[str]:
    """The files mapped into this process (Linux's /proc/self/maps: the path is the sixth field)."""
    with open("/proc/self/maps", encoding="utf-8") as maps:
        return {fields[5] for fields in (line.split() for line in maps) if len(fields) >= 6}


# GNU libgomp, Intel libiomp5, LLVM libomp, and the hashed copies wheels bundle (libgomp-<hash>.so.1).
OPENMP_RUNTIME = re.compile(r"lib(gomp|iomp5|omp)([-.]|$)")


@pytest.mark.clause("KERN-25")
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_the_library_shares_torchs_openmp_runtime() -> None:
    """KERN-25: with the library loaded, exactly one OpenMP runtime is mapped into the process: the library's
    libgomp.so.1 resolved to the one torch loaded (one thread pool, not two). This holds only where torch's build
    provides libgomp.so.1 itself; a torch bundling its runtime under another name fails here."""
    library = cpu_build.load_library()
    files = mapped_files()
    assert os.path.realpath(library._name) in {os.path.realpath(f) for f in files}
    runtimes = sorted(f for f in files if OPENMP_RUNTIME.match(Path(f).name))
    assert len(runtimes) == 1, runtimes


@pytest.mark.clause("KERN-24")
def test_chooser_falls_back_to_torch_and_says_why(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """KERN-24: without a C compiler, when the build fails or when the cache folder cannot be written,
    get_backend(None, cpu) warns with the reason and returns the torch backend; asking for "cpu" by name is a
    ValueError with the same reason."""
    monkeypatch.setattr(cpu_build, "COMPILERS", ("nanoverify-no-such-cc",))
    with pytest.warns(RuntimeWarning, match="no C compiler on the PATH"):
        assert get_backend(None, CPU).name == "torch"
    with pytest.raises(ValueError, match="backend 'cpu' is unavailable: no C compiler"):
        get_backend("cpu", CPU)
    monkeypatch.undo()  # the compilers again, and the fixture's cache root
    monkeypatch.setenv("NANOVERIFY_CACHE", str(fresh_cache.parent))
    real_source = cpu_build.SOURCE
    broken = fresh_cache.parent / "cpu_attention.c"
    broken.write_text("this is not C;\n", encoding="utf-8")
    monkeypatch.setattr(cpu_build, "SOURCE", broken)
    compiler = cpu_build.find_compiler()
    assert compiler is not None
    cpu_build.forget()
    with pytest.warns(RuntimeWarning, match=r"compiling cpu_attention.c and cpu_linear.c with .* failed \(exit"):
        assert get_backend(None, CPU).name == "torch"
    assert [p.name for p in fresh_cache.iterdir()] == [f".{cpu_build.library_path(compiler).name}.lock"]  # nothing else
    with pytest.raises(ValueError, match="backend 'cpu' runs on the CPU only"):
        get_backend("cpu", torch.device("meta"))
    monkeypatch.setattr(cpu_build, "SOURCE", real_source)
    not_a_folder = fresh_cache.parent / "a-file"
    not_a_folder.write_text("", encoding="utf-8")
    monkeypatch.setenv("NANOVERIFY_CACHE", str(not_a_folder))
    cpu_build.forget()
    with pytest.warns(RuntimeWarning, match="cannot write the kernel cache folder"):
        assert get_backend(None, CPU).name == "torch"


@pytest.mark.clause("ENG-26", "KERN-24")
@pytest.mark.usefixtures("engine_env")
def test_engine_decodes_the_whole_batch_in_the_schedulers_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """ENG-26, KERN-24: on the CPU the engine picks the "cpu" backend and its eager decode hands each layer's decode
    the whole batch, in the scheduler's order (no sorting, no ranges); float64 greedy output is transformers'."""
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))] for _ in range(7)]
    max_tokens = [4 + 3 * i for i in range(7)]
    llm = make_llm(num_kvcache_blocks=96)
    runner = llm.engine.runner
    assert runner.backend.name == "cpu" and runner.graphs is None
    batches: list[list[int]] = []
    calls: list[list[int]] = []
    run, decode = runner.run, runner.backend.decode

    def watched_run(seqs: Sequence[ScheduledSeq], is_prefill: bool, draws: Sequence[DrawParams]) -> list[int]:
        if not is_prefill:
            batches.append([s.num_tokens for s in seqs])
        return run(seqs, is_prefill, draws)

    def watched_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, *rest: Any) -> Any:
        calls.append(lens.tolist())
        return decode(q, k, v, lens, *rest)

    monkeypatch.setattr(runner, "run", watched_run)
    monkeypatch.setattr(runner.backend, "decode", watched_decode)
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    layers = runner.model.config.num_layers
    assert any(len(b) > 1 and b != sorted(b) for b in batches)  # an order that sorting would have changed
    assert calls == [b for b in batches for _ in range(layers)]
    assert got == hf_greedy(checkpoint("qwen3"), prompts, max_tokens)
