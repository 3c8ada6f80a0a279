"""The memory-bandwidth floor of a decode step, and the engine's measured decode step beside it.

Invariants: a decode step of B sequences must at least read every weight once, read the K and V of every token
each sequence attends to in every layer, and write the new token's K and V; the floor is those bytes over the
device's copy bandwidth (GPU-7..GPU-9 in spec/gpu.md):

    W      = sum of the model's distinct parameter bytes, less the embedding matrix when it is not tied (then only
             the B rows gathered are read), plus B * hidden * e for the gathered embedding rows
    KV_r   = sum_b ctx_b * 2 * L * kvh * d * e          (ctx_b: tokens sequence b attends to, the new one included)
    KV_w   = B * 2 * L * kvh * d * e
    BW     = 2 * S / t_copy(S)                           (one copy of S bytes reads S and writes S; best of n)
    floor  = (W + KV_r + KV_w) / BW

Activations, logits and the sampler are left out, so the floor is a lower bound. The step time is the wall time of
``LLM.step()`` (scheduler, input preparation, forward, sampling and the token's trip to the host; the LLM's lock
around it), timed only on steps whose decode batch is exactly B.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from optimized.engine.assembly import kv_bytes_per_block
from optimized.engine.sampling_params import SamplingParams
from optimized.entry.llm import LLM
from optimized.models.decoder import CausalLM


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes per second moved by ``dst.copy_(src)`` of ``nbytes`` (read + write counted), best of ``repeats``."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the pages, and any lazy initialisation, before timing
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def kv_bytes_per_token(model: CausalLM) -> int:
    """K and V of one token in every layer (the engine's own formula, for blocks of one token)."""
    return kv_bytes_per_block(model.config, 1, model.embed_tokens.weight.dtype)


def weight_bytes(model: CausalLM, batch: int) -> int:
    """W above: what a decode step of ``batch`` sequences must read of the weights."""
    embed = model.embed_tokens.weight
    distinct = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    total = sum(distinct.values())
    if not model.config.tie_word_embeddings:
        total -= embed.numel() * embed.element_size()
    return total + batch * model.config.hidden_size * embed.element_size()


@dataclass(frozen=True)
class Floor:
    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    bandwidth: float  # bytes per second

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    @property
    def seconds(self) -> float:
        return self.bytes / self.bandwidth


def decode_floor(model: CausalLM, context_lens: list[int], bandwidth: float) -> Floor:
    per_token = kv_bytes_per_token(model)
    return Floor(
        weight_bytes=weight_bytes(model, len(context_lens)),
        kv_read_bytes=sum(context_lens) * per_token,
        kv_write_bytes=len(context_lens) * per_token,
        bandwidth=bandwidth,
    )


@dataclass(frozen=True)
class DecodeStep:
    seconds: float
    context_lens: list[int]  # per sequence: the tokens it attends to in this step


def time_decode_steps(llm: LLM, prompts: list[list[int]], warmup: int, steps: int) -> list[DecodeStep]:
    """Serve ``prompts`` (greedy, eos ignored) and time ``steps`` decode steps of the whole batch after ``warmup``.

    Every request asks for more tokens than are timed, so the batch stays whole; prefill steps (and any decode
    step of a smaller batch) are run but not timed. The requests are left unfinished: the caller drops the LLM.
    """
    params = SamplingParams(temperature=0.0, max_tokens=warmup + steps + 2, ignore_eos=True)
    requests = [(llm.add_request(p, params), len(p)) for p in prompts]
    batch, seen = len(prompts), 0
    timed: list[DecodeStep] = []
    device = llm.device
    while len(timed) < steps:
        contexts = [length + len(llm.completion_tokens(i) or ()) for i, length in requests]
        before = llm.stats.decode_tokens
        _sync(device)
        start = time.perf_counter()
        if not llm.has_unfinished_requests():
            raise RuntimeError(f"the requests finished before {steps} decode steps of batch {batch} were timed")
        llm.step()
        _sync(device)
        seconds = time.perf_counter() - start
        if llm.stats.decode_tokens - before != batch:
            continue
        seen += 1
        if seen > warmup:
            timed.append(DecodeStep(seconds, contexts))
    return timed
