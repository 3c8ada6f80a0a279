"""``nanoverify bench scheduler``: the reference and the optimized scheduler, side by side, on the same workloads.

Workloads are shaped like nano-vllm's bench.py (prompts of 100-1024 random
tokens, 100-1024 output tokens with ignore_eos, all requests arriving at once,
max_num_batched_tokens 16384, max_num_seqs 512) and vary one thing each: the
request count, the block size, a KV cache too small for the workload (so decode
preempts), a 512-token system prompt shared by every request (so the
prefix cache hits), and eight 256-token system prompts interleaved in that small
cache (the one workload on which lpm reorders the queue). No model runs: the token handed to postprocess for the k-th
sequence of a batch is the k-th of a pre-drawn list of random ints, the same
for both sides. Only schedule() and postprocess() are timed (perf_counter
around each call, the garbage collector parked for both sides alike); each
side's best of ``repeat`` runs is reported. The per-step batches (arrival ids
and the prefill flag) of the two sides are compared, so a speed-up that
changed a decision is reported as a failure, not as a number.

``--policy NAME`` (spec/policies.md) times that policy's reference (reference/, beside the lesson's) against its
optimized class (``optimized.core.policies.make_scheduler``) on the same workloads, ``--policy all`` each policy in
turn; under ``priority`` every request carries a priority drawn from the seed (0..3), the same on both sides, so the
queues are really reordered; ``lpm`` runs with the default patience. The lesson's target is 10x (OPT-13), each other
policy's 2x (POLICY-20).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from optimized.core.config import DEFAULT_PATIENCE, POLICIES
from optimized.engine.arg_types import any_int, bounded_int

MAX_REPEAT = 1000
TARGETS = {"lesson": 10.0, "mixed": 2.0, "priority": 2.0, "lpm": 2.0}  # OPT-13; POLICY-20
PRIORITY_LEVELS = 4


@dataclass(frozen=True)
class Workload:
    name: str
    block_size: int
    num_blocks: int
    prompts: list[list[int]]
    max_tokens: list[int]
    priorities: list[int]  # read under the priority policy only


@dataclass
class Result:
    seconds: float
    steps: int
    preemptions: int
    signature: list[tuple[bool, tuple[int, ...]]]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def make_workload(name: str, num_requests: int, block_size: int, seed: int, kv_fraction: float = 1.0,
                  system_prompt: int = 0, system_prompts: int = 1) -> Workload:
    """Random prompts and lengths; ``kv_fraction`` < 1 shrinks the cache below the workload's peak need; each prompt
    opens with one of ``system_prompts`` shared prompts of ``system_prompt`` tokens (more than one: drawn per
    request, so they interleave and lpm reorders the queue)."""
    rng = random.Random(seed)
    shared = [[rng.randrange(32000) for _ in range(system_prompt)] for _ in range(system_prompts)]
    prompts = [(shared[0] if system_prompts == 1 else shared[rng.randrange(system_prompts)])
               + [rng.randrange(32000) for _ in range(rng.randint(100, 1024))] for _ in range(num_requests)]
    max_tokens = [rng.randint(100, 1024) for _ in range(num_requests)]
    # Enough blocks for every request at its longest, all at once: nothing is ever preempted.
    need = sum(ceil_div(len(p) + m, block_size) for p, m in zip(prompts, max_tokens, strict=True))
    longest = max(ceil_div(len(p) + m, block_size) for p, m in zip(prompts, max_tokens, strict=True))
    num_blocks = max(longest, int(need * kv_fraction))
    priorities = [rng.randrange(PRIORITY_LEVELS) for _ in range(num_requests)]  # drawn last: the rest is unchanged
    return Workload(name, block_size, num_blocks, prompts, max_tokens, priorities)


def workloads(quick: bool, seed: int) -> list[Workload]:
    sizes = (64, 128) if quick else (256, 512)
    small = sizes[0]
    out = [make_workload(f"{n} req, block 256", n, 256, seed) for n in sizes]
    out += [make_workload(f"{n} req, block 16", n, 16, seed) for n in sizes]
    out.append(make_workload(f"{small} req, block 16, KV 30%", small, 16, seed, kv_fraction=0.3))
    out.append(make_workload(f"{small} req, block 16, 512-token system prompt", small, 16, seed, system_prompt=512))
    # Several system prompts interleaved: the one workload here on which lpm decides otherwise than the lesson (one
    # shared prompt, or none, gives every waiting request the same cached prefix, and lpm keeps the lesson's order;
    # a cache that holds every request admits the queue at once).
    out.append(make_workload(f"{small} req, block 16, 8 system prompts of 256, KV 30%", small, 16, seed,
                             kv_fraction=0.3, system_prompt=256, system_prompts=8))
    return out


def build(impl: ModuleType, w: Workload, policy: str) -> tuple[Any, Callable[[Any, int], None]]:
    """``impl``'s scheduler of ``policy`` for ``w`` (the reference's class for the reference module, the optimized
    factory's for the optimized), and how to add a sequence with its priority."""
    limits = {"num_blocks": w.num_blocks, "block_size": w.block_size, "max_num_seqs": 512,
              "max_num_batched_tokens": 16384, "eos": -1}
    if impl.__name__ == "reference":
        from optimized.verify.reference_port import REFERENCES
        from reference.lpm_scheduler import LpmScheduler

        config = impl.SchedulerConfig(**limits)
        scheduler: Any = LpmScheduler(config, DEFAULT_PATIENCE) if policy == "lpm" else REFERENCES[policy](config)
        if policy == "priority":
            return scheduler, lambda seq, priority: scheduler.add(seq, priority)
        return scheduler, lambda seq, priority: scheduler.add(seq)
    from optimized.core.policies import make_scheduler

    port = make_scheduler(impl.SchedulerConfig(**limits, policy=policy, patience=DEFAULT_PATIENCE))
    return port, lambda seq, priority: port.add(seq, (), priority)


def run(impl: ModuleType, w: Workload, tokens: list[int], policy: str = "lesson") -> Result:
    scheduler, add = build(impl, w, policy)
    seqs = [impl.Sequence(p, impl.SamplingParams(max_tokens=m, ignore_eos=True), w.block_size)
            for p, m in zip(w.prompts, w.max_tokens, strict=True)]
    first = seqs[0].seq_id
    for seq, priority in zip(seqs, w.priorities, strict=True):
        add(seq, priority if policy == "priority" else 0)
    signature: list[tuple[bool, tuple[int, ...]]] = []
    seconds = 0.0
    preemptions = 0
    clock = time.perf_counter
    gc.collect()
    gc.disable()
    try:
        while not scheduler.is_finished():
            waiting_before = len(scheduler.waiting)
            t0 = clock()
            batch, is_prefill = scheduler.schedule()
            t1 = clock()
            if not is_prefill:  # a decode step admits nobody: every new waiting sequence was preempted
                preemptions += len(scheduler.waiting) - waiting_before
            signature.append((is_prefill, tuple(s.seq_id - first for s in batch)))
            step_tokens = tokens[: len(batch)]
            t2 = clock()
            scheduler.postprocess(batch, step_tokens, is_prefill)
            seconds += (t1 - t0) + (clock() - t2)
    finally:
        gc.enable()
    return Result(seconds, len(signature), preemptions, signature)


def best_of(impl: ModuleType, w: Workload, tokens: list[int], repeat: int, policy: str = "lesson") -> Result:
    results = [run(impl, w, tokens, policy) for _ in range(repeat)]
    return min(results, key=lambda r: r.seconds)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="64 and 128 requests instead of 256 and 512")
    p.add_argument("--repeat", type=bounded_int(1, MAX_REPEAT), default=None,
                   help="runs per side and workload, the best kept (default 3, quick 1)")
    p.add_argument("--seed", type=any_int, default=0)
    p.add_argument("--policy", choices=(*POLICIES, "all"), default="lesson",
                   help="the scheduling policy timed, its reference against its optimized class, or all of them "
                   "in turn (default: lesson)")


def main(args: argparse.Namespace) -> int:
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else 3)
    if not 1 <= repeat <= MAX_REPEAT:
        raise ValueError(f"--repeat must be in [1, {MAX_REPEAT}], got {repeat}")
    policy = args.policy
    policies = list(POLICIES) if policy == "all" else [policy]
    if not set(policies) <= set(POLICIES):
        raise ValueError(f"--policy must be one of {', '.join(POLICIES)} or all, got {policy!r}")
    reference = importlib.import_module("reference")
    optimized = importlib.import_module("optimized")
    rng = random.Random(args.seed + 1)
    tokens = [rng.randrange(32000) for _ in range(512)]
    print(f"schedule()+postprocess() seconds, best of {repeat}; same decisions checked step by step")
    print(f"{'policy':<9} {'workload':<44} {'blocks':>7} {'steps':>6} {'preempt':>7} {'reference':>10} "
          f"{'optimized':>10} {'ratio':>7}")
    slowest: dict[str, float] = {}
    for name in policies:
        worst = float("inf")
        for w in workloads(args.quick, args.seed):
            ref = best_of(reference, w, tokens, repeat, name)
            opt = best_of(optimized, w, tokens, repeat, name)
            if ref.signature != opt.signature or ref.preemptions != opt.preemptions:
                print(f"{name} {w.name}: DECISIONS DIFFER (steps {ref.steps} vs {opt.steps})")
                return 1
            ratio = ref.seconds / opt.seconds
            worst = min(worst, ratio)
            print(f"{name:<9} {w.name:<44} {w.num_blocks:>7} {ref.steps:>6} {ref.preemptions:>7} "
                  f"{ref.seconds:>10.4f} {opt.seconds:>10.4f} {ratio:>6.1f}x", flush=True)
        slowest[name] = worst
    for name, worst in slowest.items():
        target = TARGETS[name]
        print(f"{name}: slowest speed-up {worst:.1f}x (target {target:g}x: {'met' if worst >= target else 'MISSED'})")
    return 0
