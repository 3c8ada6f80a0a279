"""The engine flags every command that builds an ``LLM`` shares: ``add_engine_arguments`` and ``llm_kwargs``.

Each flag is named after the ``LLM(...)`` argument it sets (``--block-size`` sets
``kvcache_block_size``); a flag not given leaves the ``LLM`` default. Values are
range-checked at parse time (CLI-2); the ``LLM`` checks the rest (ENG-9).
"""

from __future__ import annotations

import argparse
from typing import Any

from optimized.cli.arguments import any_int, bounded_int, checkpoint_folder, positive_seconds

DTYPE_CHOICES = ["float32", "float64", "bfloat16", "float16"]
# flag destination -> LLM keyword
_KEYWORDS = {
    "dtype": "dtype",
    "device": "device",
    "num_kvcache_blocks": "num_kvcache_blocks",
    "block_size": "kvcache_block_size",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "max_model_len": "max_model_len",
    "seed": "seed",
    "check": "check",
    "tensor_parallel_size": "tensor_parallel_size",
    "attention_backend": "attention_backend",
    "enforce_eager": "enforce_eager",
    "cpu_kvcache_gib": "cpu_kvcache_gib",
    "gpu_memory_utilization": "gpu_memory_utilization",
}
ATTENTION_BACKENDS = ["torch", "cpu", "triton", "flash-attn"]


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", type=checkpoint_folder, default=None,
                   help="checkpoint folder (default: the embedded default model)")
    p.add_argument("--dtype", default=None, choices=DTYPE_CHOICES, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--num-kvcache-blocks", type=bounded_int(1), default=None,
                   help="KV-cache blocks (default: what the memory budget holds)")
    p.add_argument("--block-size", type=bounded_int(2), default=None, help="tokens per KV-cache block (16)")
    p.add_argument("--max-num-seqs", type=bounded_int(1), default=None, help="sequences per step (256)")
    p.add_argument("--max-num-batched-tokens", type=bounded_int(1), default=None, help="tokens per step (8192)")
    p.add_argument("--max-model-len", type=bounded_int(2), default=None,
                   help="prompt + completion tokens (default: the model's)")
    p.add_argument("--seed", type=any_int, default=None, help="seed of unseeded requests' seeds (0)")
    p.add_argument("--check", action="store_true", default=None,
                   help="shadow every step with the reference scheduler (check mode)")
    p.add_argument("--tensor-parallel-size", type=bounded_int(1), default=None,
                   help="split the model over this many processes (spec/parallel.md; under torchrun: its WORLD_SIZE)")
    p.add_argument("--attention-backend", default=None, choices=ATTENTION_BACKENDS,
                   help="default: flash-attn or triton on CUDA, the C kernels (cpu) or torch on the CPU")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="no CUDA-graph decode (--no-enforce-eager: CUDA graphs required; default: where possible)")
    p.add_argument("--cpu-kvcache-gib", type=positive_seconds, default=None, metavar="GIB",
                   help="the KV cache's memory budget on the CPU, without --num-kvcache-blocks (0.5)")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=None, metavar="F",
                   help="the fraction of GPU memory the engine may use, in (0, 1] (0.9)")


def _fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = positive_seconds(text)  # a finite number > 0, or its one-line refusal
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``LLM`` keyword arguments the flags set (those given only), ``model`` included."""
    kwargs: dict[str, Any] = {"model": args.model}
    for dest, keyword in _KEYWORDS.items():
        value = getattr(args, dest, None)
        if value is not None:
            kwargs[keyword] = value
    return kwargs


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The command-line flags that give another command the same engine options (those given only)."""
    flags: list[str] = []
    for dest in ("model", *_KEYWORDS):
        value = getattr(args, dest, None)
        flag = "--" + dest.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        elif value is not None:
            flags += [flag, str(value)]
    return flags
