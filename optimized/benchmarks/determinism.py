"""``nanoverify bench determinism``: does a request get the same tokens and logprob bits alone as in a crowd?
(spec/batch-invariance.md, BI-11)

N requests (random prompts, greedy and seeded, each asking for its generated tokens' and its prompt tokens'
logprobs) run, in each mode (batch-invariant off and on):
- alone: each in a fresh engine of the command's settings, by itself;
- in a crowd: all N with random batch mates (every other one starting with a needle's prompt), in a random order,
  in one engine whose token budget is small (prompts are prefilled in chunks) and whose KV blocks are few
  (sequences are preempted and recomputed), twice: the second pass is the same crowd in another order on the same
  engine, whose prefix cache the first pass filled.
Each pass is set against the alone runs: how many requests got other tokens, how many other logprob bits (any
float of any generated or prompt token's entry, bit for bit, or another id or rank), and where the first difference
is (the output position of the first generated token whose entry differs, or ``prompt`` when only the prompt
logprobs do), as the earliest and a histogram. The crowd passes are timed in alternation (off, on, on, off), wall
and CPU seconds per mode, and the ratio. The regimes are counted and printed (preemptions, chunked prefills,
prefix-cache hit tokens), so a reader sees that they happened. Exit status 1 when the mode on shows any difference.
Torch and the engine are imported only when the benchmark runs.
"""

from __future__ import annotations

import argparse
import random
import struct
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from optimized.engine.arg_types import MAX_THREADS, bounded_int
from optimized.engine.args import EngineArgs
from optimized.engine.sampling_params import MAX_LOGPROBS, Logprob, SamplingParams

if TYPE_CHECKING:
    from optimized.entry.llm import LLM, RequestOutput

DEFAULTS: dict[str, Any] = {"num_requests": 16, "mates": 24, "max_input_len": 64, "max_output_len": 24,
                            "logprobs": 5, "token_budget": 24}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=bounded_int(1, 4096), default=DEFAULTS["num_requests"],
                   help="requests run alone and in the crowd (default: %(default)s)")
    p.add_argument("--mates", type=bounded_int(0, 4096), default=DEFAULTS["mates"],
                   help="random batch mates in the crowd (default: %(default)s)")
    p.add_argument("--max-input-len", type=bounded_int(1), default=DEFAULTS["max_input_len"],
                   help="prompts of 1..this many tokens (default: %(default)s)")
    p.add_argument("--max-output-len", type=bounded_int(1), default=DEFAULTS["max_output_len"],
                   help="outputs of 1..this many tokens (default: %(default)s)")
    p.add_argument("--logprobs", type=bounded_int(0, MAX_LOGPROBS), default=DEFAULTS["logprobs"],
                   help="top logprobs per generated and prompt token (default: %(default)s)")
    p.add_argument("--token-budget", type=bounded_int(1), default=DEFAULTS["token_budget"],
                   help="the crowd engine's max_num_batched_tokens: prompts longer are chunked (default: "
                   "%(default)s)")
    p.add_argument("--threads", type=bounded_int(1, MAX_THREADS), default=None,
                   help="torch CPU threads for every run (default: torch's)")
    EngineArgs.add_cli_args(p, exclude=("batch_invariant", "trace", "trace_wall_times", "max_num_batched_tokens"))


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    params: SamplingParams


def make_requests(rng: random.Random, n: int, args: argparse.Namespace, vocab: int, logprobs: int | None
                  ) -> list[Request]:
    """``n`` random requests, every other greedy, the rest seeded (each its own seed)."""
    out = []
    for _ in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, args.max_input_len))]
        length = rng.randint(1, args.max_output_len)
        if rng.random() < 0.5:
            params = SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True, logprobs=logprobs,
                                    prompt_logprobs=logprobs)
        else:
            params = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=rng.randrange(1 << 30),
                                    max_tokens=length, ignore_eos=True, logprobs=logprobs,
                                    prompt_logprobs=logprobs)
        out.append(Request(prompt, params))
    return out


def share_prefixes(rng: random.Random, mates: list[Request], needles: list[Request]) -> list[Request]:
    """Every other mate's prompt starts with a random needle's prompt (its first 1..all tokens, then the mate's own,
    no longer than the longer of the two): prefix-cache hits on the needles' blocks in the first pass already."""
    out = []
    for i, m in enumerate(mates):
        if i % 2 == 0:
            head = rng.choice(needles).prompt
            joined = head[: rng.randint(1, len(head))] + m.prompt
            m = Request(joined[: max(len(head), len(m.prompt))], m.params)
        out.append(m)
    return out


def _entry(d: dict[int, Logprob] | None) -> tuple[tuple[int, bytes, int], ...] | None:
    """An entry as ids, float bits and ranks, in its order: equal exactly when every bit is."""
    return None if d is None else tuple((t, struct.pack("<d", lp.logprob), lp.rank) for t, lp in d.items())


def _first_difference(a: list[Any], b: list[Any]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass(frozen=True)
class Difference:
    """How one request's run differs from its run alone; None: not at all."""

    tokens_at: int | None  # the first output position whose token differs
    logprobs_at: int | str | None  # the first output position whose entry differs, or "prompt"


def difference(alone: RequestOutput, other: RequestOutput) -> Difference:
    """Where ``other`` first differs from ``alone``: tokens, and logprob entries bit for bit."""
    tokens_at = _first_difference(alone.token_ids, other.token_ids)
    logprobs_at: int | str | None = _first_difference([_entry(d) for d in alone.logprobs or []],
                                                      [_entry(d) for d in other.logprobs or []])
    if logprobs_at is None and ([_entry(d) for d in alone.prompt_logprobs or []]
                                != [_entry(d) for d in other.prompt_logprobs or []]):
        logprobs_at = "prompt"
    return Difference(tokens_at, logprobs_at)


def summary(diffs: list[Difference]) -> str:
    """One line: how many differ in tokens and in logprob bits, and where the logprobs first differ."""
    n = len(diffs)
    tokens = sum(d.tokens_at is not None for d in diffs)
    where = Counter(d.logprobs_at for d in diffs if d.logprobs_at is not None)
    line = f"{tokens}/{n} requests differ in tokens, {sum(where.values())}/{n} in logprob bits"
    if not where:
        return line
    positions = sorted(k for k in where if isinstance(k, int))
    earliest = positions[0] if positions else "prompt"
    keys: list[int | str] = [*positions, *(["prompt"] if "prompt" in where else [])]
    histogram = ", ".join(f"{k}: {where[k]}" for k in keys)
    return f"{line}; first logprob difference at output position {earliest} (histogram {{{histogram}}})"


@dataclass(frozen=True)
class Timing:
    wall: float
    cpu: float


def timed_generate(llm: LLM, requests: list[Request]) -> tuple[list[RequestOutput], Timing]:
    wall, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate([r.prompt for r in requests], [r.params for r in requests], use_tqdm=False)
    return outs, Timing(time.perf_counter() - wall, time.process_time() - cpu)


def tight_blocks(requests: list[Request], block_size: int) -> int:
    """Enough KV blocks for the longest request alone, and a sixth of the crowd's need: the crowd preempts."""
    need = [-(-(len(r.prompt) + r.params.max_tokens) // block_size) for r in requests]
    return max(max(need) + 1, sum(need) // 6)


def main(args: argparse.Namespace) -> int:
    import torch

    from optimized.entry.llm import LLM

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    engine = EngineArgs.from_cli_args(args)
    modes = (False, True)
    probe = LLM(**replace(engine, batch_invariant=True).as_kwargs())  # where the mode cannot hold, refused here
    limits, block_size = probe.limits, engine.kvcache_block_size
    del probe
    lengths = f"--max-input-len {args.max_input_len} + --max-output-len {args.max_output_len}"
    if args.max_input_len + args.max_output_len > limits.max_model_len:
        raise ValueError(f"{lengths} exceeds the model's max_model_len={limits.max_model_len}")
    if limits.room(args.max_input_len) < args.max_output_len:
        raise ValueError(f"{lengths} cannot fit the KV cache of a request run alone ({limits.num_blocks} blocks "
                         f"of {limits.block_size} tokens: --num-kvcache-blocks, --block-size)")
    vocab = limits.vocab_size
    rng = random.Random(engine.seed)
    needles = make_requests(rng, args.num_requests, args, vocab, args.logprobs)
    mates = share_prefixes(rng, make_requests(rng, args.mates, args, vocab, None), needles)
    crowd = needles + mates
    order = [list(range(len(crowd))) for _ in range(2)]
    for o in order:
        rng.shuffle(o)
    blocks = tight_blocks(crowd, block_size)
    crowd_args = replace(engine, num_kvcache_blocks=blocks, max_num_batched_tokens=args.token_budget)
    print(f"workload: {len(needles)} requests (prompts 1..{args.max_input_len} tokens, outputs "
          f"1..{args.max_output_len}, greedy and seeded, logprobs and prompt_logprobs {args.logprobs}) alone in fresh "
          f"engines, and in a crowd with {len(mates)} random batch mates: token budget {args.token_budget}, "
          f"{blocks} KV blocks of {block_size}, two passes (the second on a hot prefix cache); "
          f"{torch.get_num_threads()} torch threads")
    alone: dict[bool, list[RequestOutput]] = {on: [] for on in modes}
    for i, r in enumerate(needles):
        for on in modes if i % 2 == 0 else modes[::-1]:
            alone[on] += LLM(**replace(engine, batch_invariant=on).as_kwargs()).generate(
                [r.prompt], [r.params], use_tqdm=False)
    engines = {on: LLM(**replace(crowd_args, batch_invariant=on).as_kwargs()) for on in modes}
    passes: dict[bool, list[list[RequestOutput]]] = {on: [[], []] for on in modes}
    times: dict[bool, list[Timing]] = {on: [] for on in modes}
    regimes: dict[bool, list[str]] = {on: [] for on in modes}
    for p, mode_order in enumerate((modes, modes[::-1])):
        for on in mode_order:
            llm = engines[on]
            before = replace(llm.stats)
            outs, timing = timed_generate(llm, [crowd[i] for i in order[p]])
            by_index = dict(zip(order[p], outs, strict=True))
            passes[on][p] = [by_index[i] for i in range(len(needles))]
            times[on].append(timing)
            s = llm.stats
            regimes[on].append(f"{s.preemptions - before.preemptions} preemptions, "
                               f"{s.chunked_prefills - before.chunked_prefills} chunked prefills, "
                               f"{s.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens} prefix-cache hit tokens")
    found_on = 0
    wall = {on: sum(t.wall for t in times[on]) for on in modes}
    cpu = {on: sum(t.cpu for t in times[on]) for on in modes}
    for on in modes:
        name = "on " if on else "off"
        for p in range(2):
            diffs = [difference(a, b) for a, b in zip(alone[on], passes[on][p], strict=True)]
            if on:
                found_on += sum(d != Difference(None, None) for d in diffs)
            print(f"mode {name}, crowd pass {p + 1} ({regimes[on][p]}): {summary(diffs)}")
        print(f"mode {name}: crowd passes {wall[on]:.2f} s ({cpu[on]:.2f} CPU s)")
    print(f"ratio (on / off time): wall {wall[True] / wall[False]:.3f}, CPU {cpu[True] / cpu[False]:.3f}")
    return 1 if found_on else 0


__all__ = ["DEFAULTS", "Difference", "add_arguments", "difference", "main", "summary"]
