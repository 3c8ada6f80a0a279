"""``nanoverify bench check``: what check mode costs (spec/check.md, CHECK-5): the engine unchecked and checked on
the same workloads, side by side in one run.

Two engines of the same settings (``EngineArgs``; one with ``check=True``: check mode is fixed when an engine is
built, and a shadow cannot skip a run) serve each workload, each warmed first, then timed in alternation,
unchecked-checked-checked-unchecked and again, so that a neighbour's load on a shared machine falls on both. Each
engine's n-th timed run gets the n-th workload drawn from the seed (so the two engines serve the same requests in
the same order, and no run finds its prompts already in the prefix cache from the run before). Each run's wall and
CPU seconds are printed, then both medians and their ratio against the target (CHECK-5: at most
``TARGET``). The workloads: ``bench``, the issue's (requests of ``prompt_len`` random tokens, each generating
``output_len`` tokens greedily, eos ignored, on the engine's defaults), and ``run``, ``nanoverify run``'s (its
prompts, output lengths and mix of greedy and sampled requests, on its engine settings: a KV cache small enough that
requests are preempted), which the command line hands in (it lives on the floor above). Torch is loaded only when
the benchmark runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from optimized.engine.arg_types import bounded_int
from optimized.engine.args import EngineArgs
from optimized.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from optimized.entry.llm import LLM

TARGET = 1.3  # checked / unchecked wall time, at most (CHECK-5)
ORDER = (False, True, True, False)  # one round: unchecked, checked, checked, unchecked
DEFAULTS: dict[str, Any] = {"num_requests": 64, "prompt_len": 64, "output_len": 64, "rounds": 2,
                            "run_requests": 128, "workloads": "bench,run"}

# ``nanoverify run``'s workload as the command line hands it in: (args, vocab) -> (prompts, output lengths).
RunWorkload = Callable[[argparse.Namespace, int], tuple[list[list[int]], list[int]]]


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    params: list[SamplingParams]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=bounded_int(1), default=DEFAULTS["num_requests"],
                   help="bench workload: requests (default: %(default)s)")
    p.add_argument("--prompt-len", type=bounded_int(1), default=DEFAULTS["prompt_len"],
                   help="bench workload: prompt tokens (default: %(default)s)")
    p.add_argument("--output-len", type=bounded_int(1), default=DEFAULTS["output_len"],
                   help="bench workload: output tokens (default: %(default)s)")
    p.add_argument("--run-requests", type=bounded_int(1), default=DEFAULTS["run_requests"],
                   help="run workload: requests (nanoverify run's own default is 256) (default: %(default)s)")
    p.add_argument("--rounds", type=bounded_int(1), default=DEFAULTS["rounds"],
                   help="timed rounds, each unchecked-checked-checked-unchecked (default: %(default)s)")
    p.add_argument("--workloads", default=DEFAULTS["workloads"],
                   help="comma-separated: bench, run (default: %(default)s)")
    EngineArgs.add_cli_args(p, exclude=("check", "trace", "trace_wall_times"))


def bench_workload(args: argparse.Namespace, vocab: int, n: int) -> Workload:
    rng = random.Random(f"{args.seed}/{n}")
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    params = [SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)] * len(prompts)
    return Workload("bench", prompts, params)


def run_params(lens: list[int]) -> list[SamplingParams]:
    """``nanoverify run``'s mix: every third request greedy to its length, the others sampled (half of them
    seeded)."""
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) if i % 3 == 0
            else SamplingParams(temperature=0.8, top_p=0.95, max_tokens=n, seed=i if i % 3 == 1 else None)
            for i, n in enumerate(lens)]


def _timed(llm: LLM, w: Workload) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    llm.generate(w.prompts, w.params, use_tqdm=False)
    return time.perf_counter() - wall, time.process_time() - cpu


def compare(engine: EngineArgs, make: Callable[[int, int], Workload], rounds: int) -> float:
    """Print each run and both medians; return checked / unchecked (median wall). ``make(vocab, n)`` builds the
    n-th workload (0: the warm-up's)."""
    from optimized.entry.llm import LLM  # torch: loaded only when the benchmark runs

    llms = {checked: LLM(**replace(engine, check=checked).as_kwargs()) for checked in (False, True)}
    try:
        vocab = llms[False].limits.vocab_size
        w = make(vocab, 0)
        for llm in llms.values():  # warm-up, untimed
            llm.generate(w.prompts[:8], w.params[:8], use_tqdm=False)
        walls: dict[bool, list[float]] = {False: [], True: []}
        for r in range(rounds):
            for checked in ORDER:
                w = make(vocab, len(walls[checked]) + 1)
                wall, cpu = _timed(llms[checked], w)
                walls[checked].append(wall)
                print(f"  {w.name} round {r + 1} {'checked  ' if checked else 'unchecked'}: {wall:6.2f} s wall, "
                      f"{cpu:6.2f} s CPU")
        shadow = llms[True].shadow
        assert shadow is not None
        unchecked_s, checked_s = statistics.median(walls[False]), statistics.median(walls[True])
        ratio = checked_s / unchecked_s
        stats = llms[True].stats
        print(f"  {w.name}: unchecked median {unchecked_s:.2f} s, checked median {checked_s:.2f} s: {ratio:.2f}x "
              f"({'within' if ratio <= TARGET else 'ABOVE'} the {TARGET}x target); {stats.compared_steps} steps "
              f"compared, {shadow.full_comparisons} full comparisons (every {shadow.full_every} steps and at "
              "the ends)")
        return ratio
    finally:
        for llm in llms.values():
            llm.close()


def main(args: argparse.Namespace, run_workload: RunWorkload | None = None,
         run_engine_defaults: dict[str, Any] | None = None) -> int:
    """Exit 0 when every workload is within the target, 1 when one is not."""
    engine = replace(EngineArgs.from_cli_args(args), check=False)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = sorted(set(names) - {"bench", "run"})
    if unknown or not names:
        raise ValueError(f"--workloads must name bench and/or run, got {args.workloads!r}")
    print(f"check mode's cost (target: checked at most {TARGET}x unchecked), {args.rounds} rounds of "
          f"{'-'.join('C' if c else 'U' for c in ORDER)}, check_full_every={engine.check_full_every}")
    within = True
    for name in names:
        if name == "bench":
            within &= compare(engine, lambda vocab, n: bench_workload(args, vocab, n), args.rounds) <= TARGET
        else:
            if run_workload is None:
                raise ValueError("the run workload needs nanoverify run's workload (the command line hands it in)")
            defaults = {k: v for k, v in (run_engine_defaults or {}).items() if k != "check"}
            settings = replace(engine, **defaults)
            run_args = argparse.Namespace(seed=args.seed, num_requests=args.run_requests, max_input_len=128,
                                          max_output_len=96)  # nanoverify run's defaults
            print(f"  run workload: {args.run_requests} requests, on nanoverify run's engine settings "
                  f"({', '.join(f'{k}={v}' for k, v in defaults.items())})")

            def make_run(vocab: int, n: int, run: RunWorkload = run_workload,
                         run_args: argparse.Namespace = run_args) -> Workload:
                prompts, lens = run(argparse.Namespace(**{**vars(run_args), "seed": run_args.seed * 1000 + n}), vocab)
                return Workload("run", prompts, run_params(lens))

            within &= compare(settings, make_run, args.rounds) <= TARGET
    return 0 if within else 1
