"""A batch-invariant linear layer: ``invariant_linear(x, weight, bias)`` is ``F.linear`` whose every output row is
the same bits whatever else is in the batch, whatever the thread count (spec/batch-invariance.md, BI-1 to BI-3, and
BI-6 for float64).

Invariant: output ``y[m, n]`` is one fixed sequence of float32 roundings that depends on K and the layer's chunk count
alone (``cpu_linear.c`` states it): K cut into ``chunks`` equal chunks, each into blocks of ``BLOCK``; a block's sum one
chain of fused multiply-adds in increasing k from +0, a chunk's sum its blocks' sums added pairwise (``pairwise_sum``),
the layer's its chunks' sums added pairwise, then the bias. The compiled kernel computes it over the weight packed in
panels of columns (``pack``); ``fixed_order_linear`` computes the very same roundings with torch alone (each fused
multiply-add emulated exactly in float64), the oracle that pins the kernel to that order and the stand-in where no C
compiler is found. Neither ever falls back to MKL: with neither at hand a call raises ``CpuKernelUnavailable``. float64
follows the same rule in double (``nv_linear_f64``), compiled only: it has no emulation. ``BoundLinear`` is the engine's
hot path: one layer's weight checked and packed once. ``float64_linear`` is the error reference.
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kernels.cpu_build import CpuKernelUnavailable, load_library, unavailable_reason

__all__ = [
    "BoundLinear",
    "CpuKernelUnavailable",
    "bind",
    "compiled_linear",
    "compiled_path",
    "fixed_order_linear",
    "float64_linear",
    "invariant_linear",
    "invariant_silu_mul",
    "linear_refusal",
    "pack",
    "pairwise_sum",
]

BLOCK = 32  # a block's chain of fused multiply-adds (cpu_linear.c's NVL_BLOCK)
MAX_CHUNKS = 255
MAX_CHUNK_FEATURES = BLOCK * ((1 << 16) - 1)  # the kernel keeps a chunk's pairwise tree of blocks in 16 levels
PANEL_BYTES = 64  # a packed panel row: 16 floats or 8 doubles (cpu_linear.c's NVL_PW32, NVL_PW64)
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# x, x row stride, packed w, bias (NULL for none), y, y row stride, M, N, K, chunks, threads.
_ARGTYPES: list[type[ctypes._SimpleCData[Any]]] = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64]
# Elements of one [rows, columns] float64 temporary of the torch emulation, kept under ~64 MB.
_EMULATION_ELEMENTS = 1 << 23


_SUFFIXES = {torch.float32: "f32", torch.float64: "f64"}


def linear_refusal(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why these tensors cannot go through the invariant linear, naming the first one at fault; None when they can."""
    named = [("x", x), ("weight", weight)] + ([("bias", bias)] if bias is not None else [])
    for name, t in named:
        if not t.is_cpu:
            return f"{name} is on {t.device}: the invariant linear runs on the CPU only"
        if t.dtype not in _SUFFIXES or t.dtype != x.dtype:
            return f"{name} is {t.dtype}: the invariant linear takes float32 or float64, the same for every tensor"
    if x.dim() < 1:
        return "x is a scalar: it needs a last dimension of in_features"
    if weight.dim() != 2:
        return f"weight {tuple(weight.shape)} is not [out_features, in_features]"
    if x.shape[-1] != weight.shape[1]:
        return f"x's last dimension {x.shape[-1]} is not weight's in_features {weight.shape[1]}"
    if bias is not None and bias.shape != (weight.shape[0],):
        return f"bias {tuple(bias.shape)} is not [out_features] = ({weight.shape[0]},)"
    return None


def _checked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunks: int = 1) -> None:
    reason = linear_refusal(x, weight, bias)
    if reason is not None:
        raise ValueError(reason)
    k = weight.shape[1]
    if not 1 <= chunks <= MAX_CHUNKS or (k and k % chunks):
        raise ValueError(f"in_features {k} does not split into {chunks} equal chunks (chunks: 1..{MAX_CHUNKS})")
    if k // chunks > MAX_CHUNK_FEATURES:
        raise ValueError(f"in_features {k} in {chunks} chunks: at most {MAX_CHUNK_FEATURES} in a chunk")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight[N, K]`` in the kernel's panels: ``[ceil(N / w), K, w]`` with ``w`` columns a panel (64 bytes) and
    ``packed[p, k, j] = weight[p * w + j, k]``, the columns past N zero."""
    width = PANEL_BYTES // weight.element_size()
    n, k = weight.shape
    panels = -(-n // width)
    padded = F.pad(weight, (0, 0, 0, panels * width - n))
    return padded.reshape(panels, width, k).transpose(1, 2).contiguous()


def pairwise_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The chunks' sums added in the kernel's order: neighbours in pairs, level after level, an odd last one carried
    up (``((p0 + p1) + (p2 + p3)) + p4``), the order of optimized/models/sharding.py's ``fixed_order_sum``."""
    level = list(parts)
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)] + level[len(level) // 2 * 2 :]
    return level[0]


@functools.cache
def _kernel(dtype: torch.dtype = torch.float32) -> Callable[..., None]:
    return bind(load_library(), dtype)


def compiled_path() -> str:
    """Which of the kernel's paths this machine's library runs ("avx512", "avx2" or "portable"); raises
    ``CpuKernelUnavailable`` when it does not build."""
    fn = load_library().nv_linear_path
    fn.restype = ctypes.c_char_p
    path: bytes = fn()
    return path.decode()


def _no_products(x: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """The layer at in_features 0: every output is the sum of no products, +0, then + bias (BI-2's rule with no
    chunk; F.linear's value, but for a bias of -0, which +0 + -0 makes +0)."""
    y = torch.zeros(*x.shape[:-1], n, dtype=x.dtype)
    return y if bias is None else y + bias


def _unit_stride_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as 2-D rows with unit stride along the last dimension (a copy only when it is not)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 or rows.shape[-1] <= 1 else rows.contiguous()


def bind(library: ctypes.CDLL, dtype: torch.dtype = torch.float32) -> Callable[..., None]:
    """``nv_linear_f32`` (or ``_f64``) of a loaded library, typed (a test binds builds for other instruction sets
    too). It takes the weight packed (``pack``)."""
    fn = getattr(library, f"nv_linear_{_SUFFIXES[dtype]}")
    fn.argtypes = [*_ARGTYPES]
    fn.restype = None
    call: Callable[..., None] = fn
    return call


def compiled_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kernel: Callable[..., None] | None = None,
    chunks: int = 1,
) -> torch.Tensor:
    """The compiled kernel on checked tensors (``kernel``: another build's ``bind``, for tests); the weight is packed
    for this one call."""
    if weight.shape[1] == 0:
        return _no_products(x, weight.shape[0], bias)
    kernel = kernel or _kernel(x.dtype)
    rows, packed = _unit_stride_rows(x), pack(weight)
    b = bias.contiguous() if bias is not None else None
    m, k = rows.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype)
    kernel(
        rows.data_ptr(), rows.stride(0), packed.data_ptr(), None if b is None else b.data_ptr(),
        y.data_ptr(), n, m, n, k, chunks, torch.get_num_threads(),
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], n)


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, chunks: int = 1
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32 or float64 CPU tensors, each output row a function of its own input
    row alone (BI-1, BI-6), K summed in ``chunks`` equal chunks (TP-12): the compiled kernel, or in float32 its torch
    emulation (the same bits, far slower) where the library does not build; float64 then raises
    ``CpuKernelUnavailable``. Bad tensors are a ValueError naming the one at fault."""
    _checked(x, weight, bias, chunks)
    reason = unavailable_reason()
    if reason is None:
        return compiled_linear(x, weight, bias, chunks=chunks)
    if x.dtype == torch.float64:
        raise CpuKernelUnavailable(f"the float64 invariant linear is compiled only: {reason}")
    return fixed_order_linear(x, weight, bias, chunks)


class BoundLinear:
    """``invariant_linear(x, weight, bias, chunks)`` with ``weight`` and ``bias`` checked, and the weight packed,
    once (the engine's layers call it every step, so the per-call work is a shape check, one ``torch.empty`` and the
    C call, which computes every chunk and their sum). It holds the packed copy (the layer's weight is not kept),
    so the pointers it bound stay valid; a layer whose weight is replaced must be bound again. Needs the compiled
    library (``CpuKernelUnavailable`` otherwise)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, chunks: int = 1) -> None:
        _checked(torch.empty(0, weight.shape[-1] if weight.dim() else 0, dtype=weight.dtype), weight, bias, chunks)
        self.bias = None if bias is None else bias.contiguous()
        self.dtype = weight.dtype
        self.out_features, self.in_features = weight.shape
        self.chunks = chunks
        self._call = _kernel(self.dtype)
        self.packed = pack(weight.detach())
        self._w = self.packed.data_ptr()
        self._b = None if self.bias is None else self.bias.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        k, n = self.in_features, self.out_features
        if x.dtype != self.dtype or x.device.type != "cpu" or x.dim() < 1 or x.shape[-1] != k:
            raise ValueError(f"x {x.dtype} {tuple(x.shape)} on {x.device} does not fit this layer's "
                             f"[*, {k}] {self.dtype} on the CPU")  # fmt: skip
        if k == 0:
            return _no_products(x, n, self.bias)
        rows = x.reshape(-1, k)
        if rows.stride(-1) != 1 and k > 1:
            rows = rows.contiguous()
        m = rows.shape[0]
        y = torch.empty(m, n, dtype=self.dtype)
        self._call(rows.data_ptr(), rows.stride(0), self._w, self._b, y.data_ptr(), n, m, n, k, self.chunks,
                   torch.get_num_threads())  # fmt: skip
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)


@functools.cache
def _silu_mul_kernel() -> Callable[..., None]:
    fn = load_library().nv_silu_mul_f32
    fn.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _I64, _I64]
    fn.restype = None
    call: Callable[..., None] = fn
    return call


def invariant_silu_mul(gate_up: torch.Tensor, width: int) -> torch.Tensor:
    """``g / (1 + exp(-g)) * u`` for ``g, u = gate_up[..., :width], gate_up[..., width:]`` (the MLP's activation in
    the batch-invariant mode, BI-8), float32 on the CPU, compiled only: every element goes through the same vector
    code (``cpu_linear.c``'s ``nv_silu_mul_f32``, with Cephes' ``expf``), so a row's bits are its own at any batch
    and thread count. Bad tensors are a ValueError naming ``gate_up``."""
    if gate_up.dtype != torch.float32 or not gate_up.is_cpu or gate_up.dim() < 1 or gate_up.shape[-1] != 2 * width:
        raise ValueError(f"gate_up {gate_up.dtype} {tuple(gate_up.shape)} on {gate_up.device} is not [*, 2 * {width}] "
                         "float32 on the CPU")  # fmt: skip
    rows = _unit_stride_rows(gate_up)
    out = torch.empty(rows.shape[0], width, dtype=torch.float32)
    _silu_mul_kernel()(rows.data_ptr(), rows.stride(0), out.data_ptr(), width, rows.shape[0], width,
                       torch.get_num_threads())  # fmt: skip
    return out.reshape(*gate_up.shape[:-1], width)


def _fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fmaf(a, b, c) elementwise, exactly: a * b is exact in float64, the sum s + e = a * b + c is exact (TwoSum),
    and s rounded to float32 is the correctly rounded result unless s is exactly halfway between two floats, where
    the sign of e decides. Finite results only (an overflow to inf is not emulated)."""
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    back = s - p
    e = (p - (s - back)) + (cd - back)
    f = s.float()
    fd = f.double()
    # The float on s's other side; s is a tie exactly when it lies halfway between f and it.
    other = torch.nextafter(f, torch.where(s > fd, torch.full_like(f, torch.inf), torch.full_like(f, -torch.inf)))
    tie = (s != fd) & (s == (fd + other.double()) * 0.5)
    toward = torch.nextafter(f, torch.where(e > 0, torch.full_like(f, torch.inf), torch.full_like(f, -torch.inf)))
    # At a tie s rounded to even; e != 0 moves the exact value off the midpoint, toward e's side.
    moved = tie & (e != 0) & (((e > 0) & (fd < s)) | ((e < 0) & (fd > s)))
    return torch.where(moved, toward, f)


def fixed_order_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, chunks: int = 1
) -> torch.Tensor:
    """The kernel's float32 roundings (BI-2) with torch alone: the oracle of ``cpu_linear.c`` and its stand-in."""
    _checked(x, weight, bias, chunks)
    if x.dtype != torch.float32:
        raise ValueError(f"x is {x.dtype}: fixed_order_linear emulates the float32 kernel only")
    if weight.shape[1] == 0:
        return _no_products(x, weight.shape[0], bias)
    rows, n, k = x.reshape(-1, x.shape[-1]), weight.shape[0], weight.shape[1]
    m, size = rows.shape[0], k // chunks
    out = torch.empty(m, n, dtype=torch.float32)
    step = max(1, _EMULATION_ELEMENTS // max(1, m))
    for n0 in range(0, n, step):
        w = weight[n0 : n0 + step]
        sums = []
        for c0 in range(0, k, size):
            blocks = []
            for b0 in range(c0, c0 + size, BLOCK):
                acc = torch.zeros(m, w.shape[0], dtype=torch.float32)
                for j in range(b0, min(b0 + BLOCK, c0 + size)):
                    acc = _fma_f32(rows[:, j, None], w[None, :, j], acc)
                blocks.append(acc)
            sums.append(pairwise_sum(blocks))
        total = pairwise_sum(sums)
        out[:, n0 : n0 + step] = total + bias[n0 : n0 + step] if bias is not None else total
    return out.reshape(*x.shape[:-1], n)


def float64_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The error reference: the layer in float64 (from the float32 inputs), a slice of weight rows at a time so a
    large vocabulary's head is never copied whole."""
    xd, step = x.double(), 16384
    parts = [
        F.linear(xd, weight[n0 : n0 + step].double(), None if bias is None else bias[n0 : n0 + step].double())
        for n0 in range(0, weight.shape[0], step)
    ]
    return torch.cat(parts, dim=-1)


# The linear layers (in_features, out_features) of the default model (optimized/models/default_model.py: hidden
# 256, 4 heads and 2 KV heads of 64, intermediate 768, vocabulary 257) and of Qwen3-0.6B (hidden 1024, 16 heads and
# 8 KV heads of 128, intermediate 3072, vocabulary 151936), q/k/v and gate/up packed as the model packs them.
MODEL_SHAPES: dict[str, dict[str, tuple[int, int]]] = {
    "default": {"qkv": (256, 512), "o": (256, 256), "gate_up": (256, 1536), "down": (768, 256), "lm_head": (256, 257)},
    "qwen3-0.6b": {
        "qkv": (1024, 4096),
        "o": (2048, 1024),
        "gate_up": (1024, 6144),
        "down": (3072, 1024),
        "lm_head": (1024, 151936),
    },
}


# The row-parallel layers, which the engine's batch-invariant mode sums in 4 chunks of K (TP-12).
CHUNKED_LAYERS = {"o": 4, "down": 4}


def _median_seconds(fn: Callable[[], torch.Tensor], budget_s: float) -> float:
    fn()  # warm: caches, thread pool
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 200):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def relative_error(y: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest |y - exact| over the largest |exact| (a scale-free error of a layer's output)."""
    return float((y.double() - exact).abs().max() / exact.abs().max().clamp_min(1e-300))


def benchmark(
    rows: tuple[int, ...] = (1, 8, 64, 256),
    threads: tuple[int, ...] = (1, 2),
    budget_s: float = 0.3,
    dtype: torch.dtype = torch.float32,
) -> list[dict[str, object]]:
    """Time MKL (``F.linear``) and the invariant kernel (``BoundLinear``, bound once as the engine binds it; the
    row-parallel layers in the engine's 4 chunks) side by side on the models' shapes and print one line each: both
    medians, their ratio, and both errors against float64 (in float64: against MKL's own result, so MKL's is 0 and
    the kernel's is their difference). Qwen3-0.6B's lm_head runs at 8 rows at most (the engine computes it for a
    sequence's last token only), and not at all in float64 (a 1.2 GB weight)."""
    saved = torch.get_num_threads()
    results: list[dict[str, object]] = []
    g = torch.Generator().manual_seed(0)
    print(f"invariant linear ({compiled_path()}) vs F.linear (MKL), {str(dtype).removeprefix('torch.')}, "
          "median seconds")  # fmt: skip
    print(f"{'model':<11} {'layer':<8} {'M':>4} {'K':>5} {'N':>6} {'ch':>2} {'th':>2} {'mkl_s':>10} {'kernel_s':>10} "
          f"{'ratio':>6} {'mkl_err':>9} {'kernel_err':>10}")  # fmt: skip
    try:
        for model, layers in MODEL_SHAPES.items():
            for layer, (k, n) in layers.items():
                if n * k > 1 << 26 and dtype == torch.float64:
                    continue
                w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
                chunks = CHUNKED_LAYERS.get(layer, 1)
                bound = BoundLinear(w, None, chunks)
                for m in rows:
                    if n * k > 1 << 26 and m > 8:
                        continue
                    x = torch.randn(m, k, generator=g).to(dtype)
                    exact = float64_linear(x, w)
                    for t in threads:
                        torch.set_num_threads(t)
                        mkl_s = _median_seconds(functools.partial(F.linear, x, w), budget_s)
                        kernel_s = _median_seconds(functools.partial(bound, x), budget_s)
                        mkl_err = relative_error(F.linear(x, w), exact)
                        kernel_err = relative_error(bound(x), exact)
                        results.append({
                            "model": model, "layer": layer, "M": m, "K": k, "N": n, "chunks": chunks, "threads": t,
                            "mkl_s": mkl_s, "kernel_s": kernel_s, "ratio": kernel_s / mkl_s,
                            "mkl_err": mkl_err, "kernel_err": kernel_err,
                        })  # fmt: skip
                        print(
                            f"{model:<11} {layer:<8} {m:>4} {k:>5} {n:>6} {chunks:>2} {t:>2} {mkl_s:>10.3e} "
                            f"{kernel_s:>10.3e} {kernel_s / mkl_s:>6.2f} {mkl_err:>9.2e} {kernel_err:>10.2e}"
                        )
    finally:
        torch.set_num_threads(saved)
    return results


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kernels.linear", description=benchmark.__doc__)
    parser.add_argument("--dtype", choices=sorted(n.removeprefix("torch.") for n in map(str, _SUFFIXES)),
                        default="float32")  # fmt: skip
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256], help="the values of M")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    benchmark(tuple(args.rows), tuple(args.threads), dtype=getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
