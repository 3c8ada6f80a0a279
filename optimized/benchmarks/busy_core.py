"""``nanoverify bench threads``: the engine's CPU settings on an idle machine and with one core taken by a neighbour.

Each configuration (torch threads x OpenMP wait policy) runs the same small workload (default 50 prompts of 1..64
tokens, 48 greedy output tokens each, eos ignored) in a fresh process, because libgomp reads ``OMP_WAIT_POLICY``
once, when torch loads it. "busy" runs it while another process spins on one core. The table prints both times and
their ratio for every configuration, and marks the one nanoverify picks by itself (spec ENG-31).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass

from optimized.engine import cpu_defaults

SPIN = "while True: pass"
# The wait policies compared: the one we set by default, libgomp's own (unset: spin a while, then sleep), and
# spinning for good.
POLICIES = ("PASSIVE", "unset", "ACTIVE")


@dataclass(frozen=True)
class Config:
    threads: int | None  # None: what nanoverify picks
    policy: str  # an OMP_WAIT_POLICY value, or "unset"

    def label(self) -> str:
        threads = "default" if self.threads is None else str(self.threads)
        return f"threads {threads:>7}, OMP_WAIT_POLICY {self.policy}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from optimized.engine.arg_types import MAX_THREADS, bounded_int

    p.add_argument("--num-requests", type=bounded_int(1), default=50)
    p.add_argument("--max-tokens", type=bounded_int(1, 4096), default=48)
    p.add_argument("--repeat", type=bounded_int(1, 100), default=1,
                   help="runs per configuration and condition, the fastest kept")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=bounded_int(1, MAX_THREADS), default=None, help=argparse.SUPPRESS)


def child(args: argparse.Namespace) -> int:
    """One timed run in this process; prints a JSON line with the wall time and the thread count used."""
    import torch

    from optimized.engine.sampling_params import SamplingParams
    from optimized.entry.llm import LLM

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    llm = LLM()
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 64))] for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up: kernels built and loaded, caches touched
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    print(json.dumps({"wall": wall, "threads": torch.get_num_threads()}))
    return 0


def run_config(config: Config, args: argparse.Namespace) -> tuple[float, int]:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if config.policy != "unset":
        env["OMP_WAIT_POLICY"] = config.policy
    if config.policy == "unset":
        env["NANOVERIFY_CPU_DEFAULTS"] = "0"  # keep libgomp's own policy in the child
    command = [sys.executable, "-m", "optimized.cli", "bench", "threads", "--child",
               "--num-requests", str(args.num_requests), "--max-tokens", str(args.max_tokens)]
    if config.threads is not None:
        command += ["--threads", str(config.threads)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        raise ValueError(f"the run with {config.label()} failed (exit {done.returncode}): {said}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return float(result["wall"]), int(result["threads"])


def timed(config: Config, args: argparse.Namespace, busy: bool) -> tuple[float, int]:
    if not busy:
        return run_config(config, args)
    spinner = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        return run_config(config, args)
    finally:
        spinner.kill()
        spinner.wait()


def main(args: argparse.Namespace) -> int:
    if args.child:
        return child(args)
    cpus = cpu_defaults.usable_cpus()
    configs = [Config(None, "PASSIVE")] + [Config(t, p) for t in sorted({1, cpus}) for p in POLICIES]
    print(f"workload: {args.num_requests} prompts of 1..64 tokens, {args.max_tokens} greedy output tokens each, "
          f"default model; {cpus} CPUs this process may use; 'busy': another process spins on one core; "
          f"fastest of {args.repeat} per cell")
    print(f"{'configuration':44} {'threads':>7} {'idle s':>8} {'busy s':>8} {'busy/idle':>10}")
    for config in configs:
        idle, threads = min(timed(config, args, busy=False) for _ in range(args.repeat))
        busy = min(timed(config, args, busy=True)[0] for _ in range(args.repeat))
        mark = "  <- nanoverify's default" if config.threads is None else ""
        print(f"{config.label():44} {threads:>7} {idle:8.2f} {busy:8.2f} {busy / idle:9.2f}x{mark}", flush=True)
    return 0
