"""A model runner from its resolved spec: the model loaded, the KV cache sized, the runner made.

Invariant: ``load_runner`` is the one sequence every engine runs, a single process and each tensor-parallel rank
alike (optimized/entry/build.py, optimized/parallel/launch.py), so the bytes of a KV block and the memory budget
are reckoned in one place. The KV cache gets ``num_kvcache_blocks`` when given (refused when this machine's memory
cannot hold them), else what the budget holds: ``gpu_memory_utilization`` of the GPU less what is taken already,
a tenth of the rest left for activations, or ``cpu_kvcache_gib`` GiB on the CPU (KNOB-3).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from optimized.engine.args import DTYPE_NAMES, EngineArgs
from optimized.engine.model_runner import ModelRunner, RankGroup
from optimized.models.config import ModelConfig


@dataclass(frozen=True)
class RunnerSpec:
    """What a rank needs to build its runner: ``EngineArgs``' runner fields, resolved (``num_kvcache_blocks`` None
    still means what the memory budget holds, the least over the ranks), and a spawned worker's torch threads.
    Plain values: spawned workers receive it pickled, and the ranks compare it (TP-8)."""

    model: str
    dtype: str  # a name of optimized.engine.args.DTYPE_NAMES
    device: str  # "cpu", "cuda" or "cuda:N"
    attention_backend: str
    kvcache_block_size: int
    num_kvcache_blocks: int | None
    gpu_memory_utilization: float
    cpu_kvcache_gib: float
    max_model_len: int
    max_num_seqs: int
    enforce_eager: bool
    tensor_parallel_size: int
    threads: int
    batch_invariant: bool = False  # resolved: on or off (last, with a default, so older positional callers hold)

    @classmethod
    def of(cls, settings: EngineArgs, threads: int) -> RunnerSpec:
        """The runner fields of ``settings``, whose Nones the build has resolved (``LLM.settings``)."""
        values = {f.name: getattr(settings, f.name) for f in fields(cls) if f.name != "threads"}
        unresolved = [name for name, value in values.items() if value is None and name != "num_kvcache_blocks"]
        if unresolved:
            raise ValueError(f"unresolved engine settings: {unresolved}")
        return cls(**{**values, "model": str(settings.model)}, threads=threads)


_TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name in ``DTYPE_NAMES``."""
    dtype: torch.dtype = _TORCH_DTYPES[name]
    return dtype


def batch_invariant_refusal(device: torch.device, dtype: str, attention_backend: str) -> str | None:
    """Why the batch-invariant mode cannot hold for these settings (BI-7), naming the one at fault; None when it
    can. It needs every kernel of the forward pass invariant: the C linear and the C attention (BI-1, BI-4). No
    tensor-parallel size is refused: in the mode the model's all-reduces add in rank order (TP-11)."""
    from kernels import cpu_build

    if device.type != "cpu":
        return f"device {device}: there are batch-invariant kernels for the CPU only"
    if dtype not in ("float32", "float64"):
        return f"dtype {dtype}: the invariant kernels take float32 or float64"
    reason = cpu_build.unavailable_reason()
    if reason is not None:
        return (f"the C kernels are unavailable ({reason}): the invariant linear would run as its torch emulation, "
                "orders of magnitude slower, and attention as torch's, which is not invariant")
    if attention_backend != "cpu":
        return (f"attention backend {attention_backend!r}: its prefill and decode sum a query's keys in different "
                "orders, so preemption and prefix-cache hits would change bits; the 'cpu' backend is invariant (BI-4)")
    return None


def kv_bytes_per_block(c: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """The K and V of ``block_size`` tokens in every layer, for the KV heads of ``c`` (under tensor parallelism,
    a rank's ``local_config``)."""
    return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * dtype.itemsize


def _physical_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _budget_blocks(dev: torch.device, per_block: int, utilization: float, cpu_gib: float) -> int:
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        # What is not free now (weights, other processes) stays taken; a tenth of the rest is left for
        # activations, which the engine does not measure.
        budget = int((total * utilization - (total - free)) * 0.9)
    else:
        budget = int(cpu_gib * (1 << 30))
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(f"the KV-cache memory budget ({budget} bytes) holds no block of {per_block} bytes")
    return blocks


def kv_cache_blocks(
    dev: torch.device, per_block: int, requested: int | None, utilization: float, cpu_gib: float
) -> int:
    """``requested`` KV blocks, or the memory budget's; on the CPU refused, naming the setting that asked, before
    the cache is made when they need more than this machine's memory."""
    blocks = _budget_blocks(dev, per_block, utilization, cpu_gib) if requested is None else requested
    asked = f"cpu_kvcache_gib={cpu_gib}" if requested is None else f"num_kvcache_blocks={requested}"
    if dev.type == "cpu" and blocks * per_block > _physical_memory():
        raise ValueError(f"{asked} needs {blocks * per_block} bytes of KV cache, more than this machine's memory "
                         f"({_physical_memory()} bytes)")
    return blocks


def load_runner(
    spec: RunnerSpec,
    device: torch.device,
    group: RankGroup | None = None,
    agree: Callable[[int], int] | None = None,
) -> ModelRunner:
    """The runner of ``spec`` on ``device``: under tensor parallelism this rank's piece of the model (``group``),
    its KV blocks settled by ``agree`` (every rank's least) before the cache is made."""
    from kernels.backend import get_backend
    from optimized.models.loader import load_model

    dtype = torch_dtype(spec.dtype)
    net = load_model(Path(spec.model), dtype, device, group)
    if spec.batch_invariant:
        net.set_batch_invariant(True)  # bound to the loaded weights
    per_block = kv_bytes_per_block(net.local_config, spec.kvcache_block_size, dtype)
    blocks = kv_cache_blocks(device, per_block, spec.num_kvcache_blocks, spec.gpu_memory_utilization,
                             spec.cpu_kvcache_gib)
    if agree is not None:
        blocks = agree(blocks)
    backend = get_backend(spec.attention_backend, device)
    if spec.batch_invariant:  # refused unless "cpu" (BI-7): its C attention, never torch's as a fallback (BI-4)
        from kernels.cpu_backend import CpuBackend

        backend = CpuBackend(batch_invariant=True)
    return ModelRunner(
        net,
        backend,
        blocks,
        spec.kvcache_block_size,
        spec.max_model_len,
        max_num_seqs=spec.max_num_seqs,
        enforce_eager=spec.enforce_eager,
        tp=group,
    )
