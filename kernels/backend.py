"""Attention backends: the paged KV store, prefill and decode behind one Protocol, chosen by name.

Invariants: every backend implements the same contract (spec/kernels.md, KERN-1..KERN-5) and is interchangeable
up to the tolerances stated there; the torch backend is the oracle. ``get_backend(None, device)`` picks the best
backend that can run on ``device`` — flash-attn on CUDA when ``flash_attn`` imports, else Triton on CUDA; on the CPU
the compiled C kernels ("cpu") when they build and load, else torch, with a warning saying why (KERN-24) — and an
explicit name that cannot run raises ValueError naming the backend and the reason.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Protocol

import torch

from kernels import cpu_build, paged_attention

BACKEND_NAMES = ("torch", "cpu", "triton", "flash-attn")


class AttentionBackend(Protocol):
    name: str

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
    ) -> torch.Tensor: ...

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
    ) -> torch.Tensor: ...


class TorchBackend:
    """Reference paged attention in plain torch; runs anywhere, matches transformers' eager arithmetic."""

    name = "torch"

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        paged_attention.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return paged_attention.paged_prefill(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return paged_attention.paged_decode(q, k_cache, v_cache, context_lens, block_tables, scale)


def reads_cache_in_place(backend: AttentionBackend) -> bool:
    """Whether ``backend``'s decode reads exactly each row's context, whatever the table width: sorting rows by
    length and trimming tables per range (ENG-19) would gain it nothing."""
    return getattr(backend, "reads_cache_in_place", False) is True


def _best_cpu_backend() -> str:
    reason = cpu_build.unavailable_reason()
    if reason is None:
        return "cpu"
    message = f"attention backend 'cpu' is unavailable, using 'torch' (a slower decode): {reason}"
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    return "torch"


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def get_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """The backend called ``name`` ("torch", "cpu", "triton", "flash-attn"), or the best one for ``device`` if None."""
    if name is None:
        if device.type == "cuda" and flash_attn_available():
            name = "flash-attn"
        elif device.type == "cuda":
            name = "triton"
        elif device.type == "cpu":
            name = _best_cpu_backend()
        else:
            name = "torch"
    if name == "torch":
        return TorchBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"backend 'cpu' runs on the CPU only, got device {device}")
        reason = cpu_build.unavailable_reason()
        if reason is not None:
            raise ValueError(f"backend 'cpu' is unavailable: {reason}")
        from kernels.cpu_backend import CpuBackend

        return CpuBackend()
    if name == "triton":
        if device.type != "cuda" and not _interpreting():
            raise ValueError(f"backend 'triton' needs a CUDA device or TRITON_INTERPRET=1, got device {device}")
        from kernels.triton_backend import TritonBackend

        return TritonBackend()
    if name == "flash-attn":
        if device.type != "cuda" or not flash_attn_available():
            raise ValueError(f"backend 'flash-attn' needs a CUDA device and the flash_attn package, got {device}")
        from kernels.flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend()
    raise ValueError(f"backend must be one of {BACKEND_NAMES} or None, got {name!r}")
