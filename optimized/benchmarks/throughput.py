"""``nanoverify bench throughput``: the engine against transformers' ``generate`` on one workload, in one run.

Both sides get the same model folder, dtype, device and requests: random
prompts of 1..max_input_len tokens, each asking for 1..max_output_len tokens,
greedy, eos ignored (so every request produces exactly its length on both
sides). The engine takes them all at once (continuous batching, check mode
off); transformers takes them in static batches of ``hf_batch_size`` in
arrival order, left-padded, each batch running until its longest request is
done. Throughput counts only requested output tokens on both sides, so
padding and over-generation in static batches are transformers' cost, as they
are in practice. A short warm-up precedes each timed run.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from optimized.llm import DTYPES, LLM
from optimized.sampling_params import SamplingParams


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_requests: int, max_input_len: int, max_output_len: int, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, max_input_len))] for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(1, max_output_len) for _ in range(num_requests)])


def _params(w: Workload) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in w.output_lens]


def run_engine(llm: LLM, w: Workload, warmup: Workload) -> float:
    """Seconds for the engine to serve the whole workload (after serving ``warmup``, other prompts)."""
    llm.generate(warmup.prompts, _params(warmup), use_tqdm=False)
    params = _params(w)
    start = time.perf_counter()
    outs = llm.generate(w.prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert sum(len(o.token_ids) for o in outs) == w.output_tokens
    return seconds


def _hf_batch(model: Any, prompts: list[list[int]], new_tokens: int, device: torch.device) -> None:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )


def run_transformers(model_dir: str, dtype: torch.dtype, device: torch.device, w: Workload, batch: int) -> float:
    """Seconds for transformers to serve the workload in static batches."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.to(device)
    model.train(False)
    with torch.inference_mode():
        _hf_batch(model, w.prompts[:4], 4, device)  # warm-up
        start = time.perf_counter()
        for i in range(0, len(w.prompts), batch):
            _hf_batch(model, w.prompts[i : i + batch], max(w.output_lens[i : i + batch]), device)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return time.perf_counter() - start


def main(args: argparse.Namespace) -> int:
    dtype_name = getattr(args, "dtype", None)
    device_name = getattr(args, "device", None)
    hf_batch_size = int(getattr(args, "hf_batch_size", None) or 32)
    llm = LLM(args.model, dtype=dtype_name, device=device_name)
    runner = llm.engine.runner
    vocab = llm.engine.limits.vocab_size
    w = make_workload(args.num_requests, args.max_input_len, args.max_output_len, vocab, args.seed)
    dtype = runner.dtype
    device = runner.device
    print(
        f"workload: {args.num_requests} requests, prompts 1..{args.max_input_len}, outputs 1..{args.max_output_len} "
        f"tokens ({w.output_tokens} output tokens), model {llm.model_dir}, {str(dtype).removeprefix('torch.')} "
        f"on {device}, {torch.get_num_threads()} threads"
    )
    warmup = make_workload(4, args.max_input_len, 4, vocab, args.seed + 1)
    engine_s = run_engine(llm, w, warmup)
    engine_tps = w.output_tokens / engine_s
    print(f"nanoverify engine:          {engine_tps:10.1f} output tok/s ({engine_s:.2f} s, continuous batching)")
    hf_s = run_transformers(str(llm.model_dir), dtype, device, w, hf_batch_size)
    hf_tps = w.output_tokens / hf_s
    print(f"transformers generate:      {hf_tps:10.1f} output tok/s ({hf_s:.2f} s, static batches of {hf_batch_size})")
    print(f"ratio (engine / transformers): {engine_tps / hf_tps:.2f}x")
    return 0


__all__ = ["DTYPES", "main", "make_workload"]
