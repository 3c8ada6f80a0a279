"""Attention backends: the paged KV store, prefill and decode behind one Protocol, chosen by name.

Invariants: every backend implements the same contract (spec/kernels.md, KERN-1..KERN-5) and is interchangeable
up to the tolerances stated there; the torch backend is the oracle. Each declares what the engine may ask of it
(``capturable``, ``reads_cache_in_place``, ``needs_decode_plan``: KERN-15), and the engine reads those, never a
backend's name; state a backend keeps for one decode step is its own plan, opaque to the engine.
``get_backend(None, device)`` picks the best backend that can run on ``device`` — flash-attn on CUDA when
``flash_attn`` imports, else Triton on CUDA; on the CPU the compiled C kernels ("cpu") when they build and load,
else torch, with a warning saying why (KERN-24) — and an explicit name that cannot run raises ValueError naming the
backend and the reason.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Protocol, TypeAlias

import torch

from kernels import cpu_build
from kernels.backend_names import BACKEND_NAMES
from kernels.torch_backend import TorchBackend

__all__ = ["BACKEND_NAMES", "AttentionBackend", "DecodePlan", "TorchBackend", "flash_attn_available", "get_backend"]


# A backend's per-step decode state: made by its ``plan_decode``, handed back unchanged to its ``decode`` in every
# layer of that step; opaque to the runner and the decoder (KERN-15).
DecodePlan: TypeAlias = object


class AttentionBackend(Protocol):
    """The KV store, prefill and decode, and what the engine may ask of them (KERN-15).

    Capabilities, each declared by every backend as a class attribute:
    ``capturable``: store_kv and decode launch without host syncs, so a CUDA graph may capture a decode step (ENG-28).
    ``reads_cache_in_place``: decode reads each row's context through its block-table row, whatever the table width,
    without gathering blocks, so the runner hands it the whole batch in the scheduler's order (ENG-26).
    ``needs_decode_plan``: an eager decode step calls ``plan_decode`` once and passes the plan to every layer's
    ``decode`` (ENG-26, ENG-30); decode must still accept ``plan=None`` (graph steps and direct calls never plan).
    """

    name: str
    capturable: bool
    reads_cache_in_place: bool
    needs_decode_plan: bool

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

    def plan_decode(self, context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> DecodePlan:
        """The state every layer's decode of one step shares; called only when ``needs_decode_plan``."""
        ...

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
        plan: DecodePlan | None = None,
    ) -> torch.Tensor: ...


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
