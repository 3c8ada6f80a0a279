"""Paged KV store and attention: torch against dense attention and transformers' eager path; Triton against torch.

Every Triton output buffer is poisoned with NaN before the call, so an element a kernel forgets to write fails.
Caches are filled with random values (never zeros) and unused blocks keep random garbage, so reading a block a
sequence does not own, or a position past its context, changes the result. Inputs are drawn on the CPU, so a case
is the same numbers on every device, then moved to the ``device`` fixture (tests/kernels/conftest.py) for the
Triton kernels and the torch oracle they are compared with; tests of the torch oracle alone stay on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

from kernels import cpu_build, paged_attention, triton_decode, triton_prefill, triton_store
from kernels.backend import TorchBackend, flash_attn_available, get_backend

TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2), torch.float16: (2e-3, 2e-3)}


@dataclass
class PagedCase:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    dense_k: list[torch.Tensor]
    dense_v: list[torch.Tensor]

    def to(self, device: torch.device) -> PagedCase:
        """The same case on ``device`` (the dense float64 references stay where they are)."""
        return PagedCase(
            self.k_cache.to(device),
            self.v_cache.to(device),
            self.block_tables.to(device),
            self.context_lens.to(device),
            self.dense_k,
            self.dense_v,
        )


def make_case(
    lens: list[int], block_size: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int, spare_blocks: int = 3
) -> PagedCase:
    """Random paged contexts: each sequence owns a random, scattered set of blocks; tables are -1 padded."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + spare_blocks
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(per_seq) + 1
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    dense_k, dense_v = [], []
    for b, (n, nb) in enumerate(zip(lens, per_seq, strict=True)):
        blocks = [order.pop() for _ in range(nb)]
        tables[b, :nb] = torch.tensor(blocks, dtype=torch.int32)
        dense_k.append(k_cache[blocks].reshape(-1, kv_heads, dim)[:n])
        dense_v.append(v_cache[blocks].reshape(-1, kv_heads, dim)[:n])
    return PagedCase(k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), dense_k, dense_v)


def cu_seqlens(qlens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Naive float64 attention of q[qlen,h,d] as the LAST qlen positions over k, v [n,kvh,d], one query at a time."""
    qlen, heads, _ = q.shape
    n, kv_heads, _ = k.shape
    out = torch.empty(qlen, heads, q.shape[-1], dtype=torch.float64)
    for i in range(qlen):
        visible = n - qlen + i + 1
        for h in range(heads):
            kv = h // (heads // kv_heads)
            scores = k[:visible, kv].double() @ q[i, h].double() * scale
            out[i, h] = torch.softmax(scores, dim=0) @ v[:visible, kv].double()
    return out


# (context lens, query lens, block size, heads, kv heads, head dim): ragged, chunked (qlen < ctx),
# prefix-cache hits (qlen = ctx - cached), odd block sizes, GQA ratios 1, 3 and 4, a context over many blocks.
PREFILL_SHAPES = [
    ([7, 1, 23], [7, 1, 23], 5, 6, 2, 12),
    ([9, 17, 4], [2, 17, 1], 3, 4, 4, 8),
    ([33, 16], [5, 16], 4, 8, 2, 16),
    ([40], [13], 1, 3, 1, 6),
]


@pytest.mark.clause("KERN-2")
@pytest.mark.parametrize(("lens", "qlens", "block_size", "heads", "kv_heads", "dim"), PREFILL_SHAPES)
def test_torch_prefill_equals_dense_causal_attention(
    lens: list[int], qlens: list[int], block_size: int, heads: int, kv_heads: int, dim: int
) -> None:
    """KERN-2: queries are the last qlen positions, causal, GQA, keys gathered through block tables."""
    case = make_case(lens, block_size, kv_heads, dim, torch.float64, seed=1)
    q = torch.randn(sum(qlens), heads, dim, dtype=torch.float64)
    cu = cu_seqlens(qlens)
    out = paged_attention.paged_prefill(q, case.k_cache, case.v_cache, cu, case.context_lens, case.block_tables, 0.3)
    for b in range(len(lens)):
        expected = dense_causal(q[cu[b] : cu[b + 1]], case.dense_k[b], case.dense_v[b], 0.3)
        torch.testing.assert_close(out[cu[b] : cu[b + 1]], expected, rtol=1e-6, atol=1e-6)


@pytest.mark.clause("KERN-3")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_attention_matches_transformers_eager(dtype: torch.dtype) -> None:
    """KERN-3: prefill is bit-identical to transformers' eager_attention_forward; decode agrees to rounding."""

    class Module(torch.nn.Module):
        num_key_value_groups = 2

    heads, kv_heads, dim, n, block_size = 4, 2, 8, 11, 3
    q = torch.randn(1, heads, n, dim, dtype=dtype)
    k = torch.randn(1, kv_heads, n, dim, dtype=dtype)
    v = torch.randn(1, kv_heads, n, dim, dtype=dtype)
    mask = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]
    expected, _ = eager_attention_forward(Module().eval(), q, k, v, mask, 0.35)
    table = torch.tensor([[3, 0, 4, 1]], dtype=torch.int32)
    k_cache = torch.randn(6, block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    slots = (table[0].long()[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
    paged_attention.store_kv(k[0].transpose(0, 1), v[0].transpose(0, 1), k_cache, v_cache, slots)
    lens = torch.tensor([n], dtype=torch.int32)
    cu = torch.tensor([0, n], dtype=torch.int32)
    out = paged_attention.paged_prefill(q[0].transpose(0, 1).contiguous(), k_cache, v_cache, cu, lens, table, 0.35)
    assert torch.equal(out, expected[0])
    last = q[0, :, -1:].transpose(0, 1).contiguous()
    decoded = paged_attention.paged_decode(last, k_cache, v_cache, lens, table, 0.35)
    torch.testing.assert_close(decoded[0], expected[0, -1], rtol=1e-6, atol=1e-6)


@pytest.mark.clause("KERN-4")
def test_torch_decode_equals_prefill_of_one_query_and_zero_context_gives_zeros() -> None:
    """KERN-4: decode is prefill with one query per sequence; a context length of 0 yields zeros, not NaN."""
    case = make_case([7, 1, 23, 12], 5, 2, 12, torch.float64, seed=2)
    q = torch.randn(4, 6, 12, dtype=torch.float64)
    cu = torch.arange(5, dtype=torch.int32)
    args = (case.k_cache, case.v_cache, case.context_lens, case.block_tables, 0.3)
    decoded = paged_attention.paged_decode(q, *args)
    prefilled = paged_attention.paged_prefill(q, case.k_cache, case.v_cache, cu, *args[2:])
    # Softmax runs in float32 by the eager contract, so float32 summation order shows even for float64 inputs.
    torch.testing.assert_close(decoded, prefilled, rtol=1e-6, atol=1e-6)
    lens = case.context_lens.clone()
    lens[1] = 0
    zeroed = paged_attention.paged_decode(q, case.k_cache, case.v_cache, lens, case.block_tables, 0.3)
    assert torch.equal(zeroed[1], torch.zeros_like(zeroed[1]))
    torch.testing.assert_close(zeroed[[0, 2, 3]], decoded[[0, 2, 3]], rtol=0, atol=0)


@pytest.mark.clause("KERN-1")
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_store_kv_writes_slots_and_skips_minus_one(impl: str, device: torch.device) -> None:
    """KERN-1: row i lands in slot_mapping[i] (block s // bs, offset s % bs); slot -1 writes nothing."""
    block_size, kv_heads, dim = 3, 2, 5
    k = torch.randn(6, kv_heads, dim).to(device)
    v = torch.randn(6, kv_heads, dim).to(device)
    slots = torch.tensor([0, -1, 7, 11, -1, 4]).to(device)
    k_cache = torch.full((4, block_size, kv_heads, dim), 123.0).to(device)
    v_cache = torch.full((4, block_size, kv_heads, dim), 123.0).to(device)
    store = triton_store.store_kv if impl == "triton" else paged_attention.store_kv
    store(k, v, k_cache, v_cache, slots)
    k_flat = k_cache.view(-1, kv_heads, dim)
    v_flat = v_cache.view(-1, kv_heads, dim)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_flat[slot], k[row]) and torch.equal(v_flat[slot], v[row])
            assert torch.equal(k_cache[slot // block_size, slot % block_size], k[row])
    untouched = [s for s in range(12) if s not in {0, 7, 11, 4}]
    assert bool((k_flat[untouched] == 123.0).all()) and bool((v_flat[untouched] == 123.0).all())


@pytest.mark.clause("KERN-5")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lens", "qlens", "block_size", "heads", "kv_heads", "dim"), PREFILL_SHAPES)
def test_triton_prefill_equals_torch(
    lens: list[int],
    qlens: list[int],
    block_size: int,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """KERN-5: Triton prefill equals the torch oracle within the dtype's tolerance, writing every output row."""
    case = make_case(lens, block_size, kv_heads, dim, dtype, seed=3).to(device)
    q = torch.randn(sum(qlens), heads, dim).to(dtype).to(device)
    cu = cu_seqlens(qlens).to(device)
    args = (case.k_cache, case.v_cache, cu, case.context_lens, case.block_tables, 0.3)
    expected = paged_attention.paged_prefill(q, *args)
    out = triton_prefill.paged_prefill(q, *args, out=torch.full_like(q, float("nan")))
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)


@pytest.mark.clause("KERN-4", "KERN-5")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("lens", "block_size", "heads", "kv_heads", "dim", "tokens_per_split"),
    [
        ([7, 1, 23, 0], 5, 6, 2, 12, 4),  # ragged, a padding row with context 0, many splits
        ([40, 3], 1, 4, 1, 8, 7),  # block size 1: a context spanning 40 blocks, splits not block-aligned
        ([17, 9, 30], 4, 8, 2, 16, 256),  # one split holds everything
    ],
)
def test_triton_decode_equals_torch(
    lens: list[int],
    block_size: int,
    heads: int,
    kv_heads: int,
    dim: int,
    tokens_per_split: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """KERN-4, KERN-5: flash-decoding (split + reduce) equals torch decode; context 0 gives zeros."""
    case = make_case(lens, block_size, kv_heads, dim, dtype, seed=4).to(device)
    q = torch.randn(len(lens), heads, dim).to(dtype).to(device)
    args = (case.k_cache, case.v_cache, case.context_lens, case.block_tables, 0.3)
    expected = paged_attention.paged_decode(q, *args)
    poisoned = torch.full_like(q, float("nan"))
    out = triton_decode.paged_decode(q, *args, out=poisoned, tokens_per_split=tokens_per_split)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))


@pytest.mark.clause("KERN-15", "KERN-24")
def test_backends_agree_end_to_end_and_selection(device: torch.device) -> None:
    """KERN-15, KERN-24: get_backend names the backends; None picks the compiled "cpu" backend on the CPU wherever a
    C compiler is found (a kernel that fails to build there is a failure, not an accepted torch fallback), torch only
    without one (Triton or flash-attn on CUDA); unknown or unusable names raise; the Triton backend agrees with torch
    on ``device``."""
    cpu = torch.device("cpu")
    if cpu_build.find_compiler() is None:
        assert get_backend(None, cpu).name == "torch"
    else:
        assert get_backend(None, cpu).name == "cpu", cpu_build.unavailable_reason()
    assert isinstance(get_backend("torch", cpu), TorchBackend)
    with pytest.raises(ValueError, match="backend"):
        get_backend("cuDNN", cpu)
    with pytest.raises(ValueError, match="flash-attn"):
        get_backend("flash-attn", cpu)
    if device.type == "cuda":
        # Compiled Triton (the conftest guarantees it on CUDA) cannot run off the GPU.
        with pytest.raises(ValueError, match="triton"):
            get_backend("triton", cpu)
        assert get_backend(None, device).name == ("flash-attn" if flash_attn_available() else "triton")
    triton_backend = get_backend("triton", device)  # on the CPU, allowed only because TRITON_INTERPRET=1
    assert triton_backend.name == "triton"
    case = make_case([6, 11], 4, 2, 8, torch.float32, seed=5).to(device)
    new_k = torch.randn(2, 2, 8).to(device)
    new_v = torch.randn(2, 2, 8).to(device)
    slots = torch.tensor([5 * 4 + 1, -1]).to(device)
    results = []
    for backend in (get_backend("torch", device), triton_backend):
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        backend.store_kv(new_k, new_v, k_cache, v_cache, slots)
        q = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0)).to(device)
        results.append(backend.decode(q, k_cache, v_cache, case.context_lens, case.block_tables, 0.3))
    torch.testing.assert_close(results[0], results[1], rtol=2e-5, atol=2e-5)
