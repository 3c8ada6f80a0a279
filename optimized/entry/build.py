"""From ``EngineArgs`` to an engine's parts: the settings resolved, the runner built, the scheduler's config and the
request limits derived from them (spec/architecture.md, ARCH-2).

Invariant: what can be refused without loading weights is refused first (the device, the attention backend and
eager mode, the tensor-parallel plan, ``max_model_len`` against the model, the batch-invariant mode where it cannot
hold); then the runner is built by optimized/engine/assembly.py's one sequence, in this process or, for
``tensor_parallel_size`` > 1, on every rank (optimized/parallel/launch.py) from the same ``RunnerSpec``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from optimized.core.config import SchedulerConfig
from optimized.core.errors import strict_int
from optimized.engine import cpu_defaults
from optimized.engine.args import EngineArgs
from optimized.engine.assembly import RunnerSpec, batch_invariant_refusal, load_runner
from optimized.engine.model_runner import ModelRunner
from optimized.engine.validation import EngineLimits
from optimized.models.config import ModelConfig, load_config
from optimized.models.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from optimized.parallel.group import Group


@dataclass(frozen=True)
class EngineParts:
    """What ``LLM`` wires together: the runner, the scheduler's config, the request limits, the resolved
    settings, the model's config and tokenizer, and rank 0's tensor-parallel group (None in a single process)."""

    runner: ModelRunner
    config: SchedulerConfig
    limits: EngineLimits
    settings: EngineArgs
    model_dir: Path
    model_config: ModelConfig
    tokenizer: Tokenizer
    group: Group | None


def _device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)  # its form EngineArgs checked
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return dev


def _model_dir(model: str | Path | None) -> Path:
    if model is None:
        from optimized.models.default_model import default_model_dir

        return default_model_dir()
    return Path(model)


def build_engine(args: EngineArgs) -> EngineParts:
    """The engine ``args`` describe (its refusals: ValueErrors naming the field). A tensor-parallel engine's
    workers run until ``launch.close(parts.group)``."""
    from kernels.backend import get_backend
    from optimized.parallel import launch

    dev = _device(args.device)
    dtype = args.dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    model_dir = _model_dir(args.model)
    cpu_defaults.cap_threads()  # ENG-31: before the first forward, so the thread pool starts at its size
    try:
        backend = get_backend(args.attention_backend, dev)
    except ValueError as e:
        raise ValueError(f"attention_backend: {e}") from None
    if args.enforce_eager is False and dev.type == "cuda" and not backend.capturable:
        raise ValueError("enforce_eager=False on CUDA needs attention_backend 'triton' or 'flash-attn'")
    if args.batch_invariant:  # only when asked: the refusal builds the C library to learn whether it can hold
        refusal = batch_invariant_refusal(dev, dtype, backend.name)
        if refusal is not None:
            raise ValueError(f"batch_invariant cannot hold: {refusal}")
    c = load_config(model_dir)
    launch.check_plan(args.tensor_parallel_size, c, dev)  # TP-1: refused before any process starts
    max_model_len = strict_int(c.max_position_embeddings if args.max_model_len is None else args.max_model_len,
                               "max_model_len", 2)
    if max_model_len > c.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's {c.max_position_embeddings}")
    enforce_eager = dev.type != "cuda" or not backend.capturable if args.enforce_eager is None else args.enforce_eager
    if args.batch_invariant is None:  # BI-10: on where it holds and costs no speed (float32 on the CPU's kernels)
        batch_invariant = (dtype == "float32" and backend.name == "cpu"
                           and batch_invariant_refusal(dev, dtype, backend.name) is None)
    else:
        batch_invariant = bool(args.batch_invariant)
    settings = replace(args, model=model_dir, dtype=dtype, device=str(dev), attention_backend=backend.name,
                       max_model_len=max_model_len, enforce_eager=enforce_eager, batch_invariant=batch_invariant)
    tokenizer = load_tokenizer(model_dir)
    size = args.tensor_parallel_size
    spec = RunnerSpec.of(settings, threads=max(1, torch.get_num_threads() // size))
    group = None
    if size > 1:
        runner, group = launch.engine_runner(spec)
    else:
        runner = load_runner(spec, dev)
    settings = replace(settings, num_kvcache_blocks=runner.num_blocks)
    limits = EngineLimits(c.vocab_size, max_model_len, runner.num_blocks, settings.kvcache_block_size,
                          c.eos_token_ids, settings.scheduling_policy)
    return EngineParts(runner, settings.scheduler_config(runner.num_blocks, c.eos), limits, settings, model_dir, c,
                       tokenizer, group)
