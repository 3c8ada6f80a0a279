"""Every Triton kernel against its torch oracle on the target device, at the bench model's own shapes.

Invariants: each check builds random inputs on the device (caches filled with noise, block tables scattered over
a larger pool, outputs poisoned with NaN so an element a kernel forgets to write fails), runs the Triton kernel
and the torch implementation on the same inputs, and compares them with the tolerance spec/kernels.md gives
(KERN-1, KERN-5, KERN-6, KERN-7, KERN-9, KERN-10, KERN-11). On a GPU the kernels are compiled; on the CPU this
module only runs with ``TRITON_INTERPRET=1`` in the environment before triton is imported. It complements the
pytest suite (tests/kernels), whose small shapes were chosen for the interpreter: here head dim, head counts,
block size and context lengths are those the engine meets when serving the bench model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from optimized.benchmarks.gpu_profile import ModelShape

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 2e-3}


@dataclass(frozen=True)
class KernelCase:
    shape: ModelShape
    dtype: torch.dtype
    device: torch.device
    block_size: int
    contexts: tuple[int, ...]  # decode contexts (0: a padding row); prefill uses the non-zero ones
    gen: torch.Generator

    def randn(self, *size: int) -> torch.Tensor:
        return torch.randn(*size, generator=self.gen, device=self.device).to(self.dtype)


def _paged(case: KernelCase, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Noise-filled caches and -1 padded block tables scattered over twice the blocks needed."""
    s, bs = case.shape, case.block_size
    need = [-(-n // bs) for n in lens]
    pool = 2 * sum(need) + 1
    k_cache = case.randn(pool, bs, s.kv_heads, s.head_dim)
    v_cache = case.randn(pool, bs, s.kv_heads, s.head_dim)
    order = torch.randperm(pool, generator=case.gen, device=case.device).to(torch.int32)
    tables = torch.full((len(lens), max(need) + 1), -1, dtype=torch.int32, device=case.device)
    start = 0
    for b, n in enumerate(need):
        tables[b, :n] = order[start : start + n]
        start += n
    return k_cache, v_cache, tables


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return bool(torch.isfinite(a).all()) and torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def check_store(case: KernelCase) -> bool:
    from kernels import paged_attention, triton_store

    s = case.shape
    k_cache, v_cache, _ = _paged(case, [case.block_size * 4])
    slots_total = k_cache.shape[0] * case.block_size
    n = min(64, slots_total)
    slots = torch.randperm(slots_total, generator=case.gen, device=case.device)[:n]
    slots[::5] = -1
    k, v = case.randn(n, s.kv_heads, s.head_dim), case.randn(n, s.kv_heads, s.head_dim)
    ours = (k_cache.clone(), v_cache.clone())
    triton_store.store_kv(k, v, *ours, slots)
    paged_attention.store_kv(k, v, k_cache, v_cache, slots)
    return torch.equal(ours[0], k_cache) and torch.equal(ours[1], v_cache)


def check_prefill(case: KernelCase) -> bool:
    from kernels import paged_attention, triton_prefill

    s = case.shape
    lens = [n for n in case.contexts if n > 0]
    qlens = [n if i % 2 == 0 else max(1, n // 3) for i, n in enumerate(lens)]  # whole prompts and tails
    k_cache, v_cache, tables = _paged(case, lens)
    q = case.randn(sum(qlens), s.heads, s.head_dim)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device=case.device)
    ctx = torch.tensor(lens, dtype=torch.int32, device=case.device)
    args = (k_cache, v_cache, cu, ctx, tables, s.head_dim**-0.5)
    out = triton_prefill.paged_prefill(q, *args, out=torch.full_like(q, float("nan")))
    return _close(out, paged_attention.paged_prefill(q, *args), TOL[case.dtype])


def check_decode(case: KernelCase) -> bool:
    from kernels import paged_attention, triton_decode

    s = case.shape
    lens = list(case.contexts)
    k_cache, v_cache, tables = _paged(case, [max(n, 1) for n in lens])
    q = case.randn(len(lens), s.heads, s.head_dim)
    ctx = torch.tensor(lens, dtype=torch.int32, device=case.device)
    args = (k_cache, v_cache, ctx, tables, s.head_dim**-0.5)
    out = triton_decode.paged_decode(q, *args, out=torch.full_like(q, float("nan")))
    return _close(out, paged_attention.paged_decode(q, *args), TOL[case.dtype])


def check_norm(case: KernelCase) -> bool:
    from kernels import norm, triton_norm

    x, residual = case.randn(33, case.shape.hidden), case.randn(33, case.shape.hidden)
    weight = (torch.rand(case.shape.hidden, generator=case.gen, device=case.device) + 0.5).to(case.dtype)
    out, new_residual = triton_norm.add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_residual = norm.add_rms_norm(x, residual, weight, 1e-6)
    return torch.equal(new_residual, ref_residual) and _within_ulps(out, ref_out, NORM_ULPS[case.dtype])


# KERN-6's bounds, in ulps of the output dtype (float32's is measured, the 16-bit ones proved).
NORM_ULPS = {torch.float32: 5, torch.bfloat16: 2, torch.float16: 2}


def _within_ulps(out: torch.Tensor, ref: torch.Tensor, ulps: int) -> bool:
    """|out - ref| <= ulps * ulp(ref), with ulp(x) = eps * 2**floor(log2 |x|), computed in float64."""
    info = torch.finfo(ref.dtype)
    ref64 = ref.double()
    ulp = info.eps * torch.exp2(torch.floor(torch.log2(ref64.abs().clamp_min(info.tiny))))
    return bool(torch.isfinite(out).all()) and bool(((out.double() - ref64).abs() <= ulps * ulp).all())


def check_rotary(case: KernelCase) -> bool:
    from kernels import rotary, triton_rotary

    s = case.shape
    table = rotary.rotary_cos_sin(s.head_dim, s.max_position, 1_000_000.0, case.dtype, case.device)
    positions = torch.randint(0, s.max_position, (29,), generator=case.gen, device=case.device)
    q, k = case.randn(29, s.heads, s.head_dim), case.randn(29, s.kv_heads, s.head_dim)
    ours = triton_rotary.apply_rotary(q, k, positions, table)
    ref = rotary.apply_rotary(q, k, positions, table)
    return torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


def check_sampling(case: KernelCase) -> bool:
    from kernels import sampling, triton_sampling

    rows, dev = 8, case.device
    logits = torch.randn(rows, case.shape.vocab, generator=case.gen, device=dev)
    temperature = torch.tensor([0.0, 0.0, 0.7, 1.0, 1.3, 0.9, 1.0, 0.5], device=dev)
    top_k = torch.tensor([-1, 5, -1, 50, -1, -1, 3, -1], dtype=torch.int64, device=dev)
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.9, 0.5, 1.0, 0.95], device=dev)
    seeds = torch.arange(rows, dtype=torch.int64, device=dev) * 7919 - 3
    positions = torch.arange(rows, dtype=torch.int64, device=dev) + 100
    args = (logits, temperature, top_k, top_p, seeds, positions)
    return torch.equal(triton_sampling.sample(*args).long(), sampling.sample(*args).long())


CHECKS: dict[str, Callable[[KernelCase], bool]] = {
    "store_kv": check_store,
    "prefill": check_prefill,
    "decode": check_decode,
    "add_rms_norm": check_norm,
    "rotary": check_rotary,
    "sampling": check_sampling,
}


def run_checks(case: KernelCase) -> dict[str, str]:
    """Check name -> "pass", "FAIL" or the exception raised; every check runs whatever the others did."""
    results: dict[str, str] = {}
    for name, check in CHECKS.items():
        try:
            results[name] = "pass" if check(case) else "FAIL"
        except Exception as e:  # one kernel's crash is reported in its row, the others still run
            results[name] = f"{type(e).__name__}: {e}"[:160]
    return results
