"""``python -m tests.mutation.check_killer --check-full-every K``: check mode as the mutation run's judge (CHECK-6).

Drives the optimized scheduler through a fixed set of workloads
(tests/check_driver.py: prefix hits, chunked prefills, preemption, aborts,
eos and max_tokens finishes, two block sizes) with a ``Shadow`` comparing the
whole states every ``K`` steps and at the ends of each run. Exit 0 when every
workload runs to its end with no divergence; else 1, after one line
``FAILED <workload>:<divergence|error|unfinished>`` (the line the mutation
runner reads as the killer) and the report. Stops at the first failure.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass

from optimized.core.config import SchedulerConfig
from optimized.core.scheduler import Scheduler
from optimized.verify.shadow import FULL_EVERY, Shadow, ShadowDivergence
from tests.check_driver import config, drive, workload


@dataclass(frozen=True)
class Workload:
    name: str
    config: SchedulerConfig
    seed: int
    requests: int
    abort_every: int


def workloads(seed: int = 0) -> Iterator[Workload]:
    """Eight runs of 40 requests (60 to 100 steps: a few full comparisons when K is 32, besides the end), each
    config with and without aborts; every config holds the longest sequence (31 tokens), so the sound pair never
    meets the empty decode."""
    configs = {
        "roomy": config(),
        "tight": config(num_blocks=16, max_num_batched_tokens=12),  # preempts
        "narrow": config(num_blocks=16, max_num_seqs=3, max_num_batched_tokens=8),  # chunks most prefills
        "bs4": config(num_blocks=16, block_size=4, max_num_seqs=6, max_num_batched_tokens=24),
    }
    for name, cfg in configs.items():
        for i, abort_every in enumerate((0, 3)):
            yield Workload(f"{name}-s{seed + i}-a{abort_every}", cfg, seed + i, 40, abort_every)


def judge(w: Workload, full_every: int) -> str:
    """'' when the workload ran to its end with no divergence, else why not: divergence, error or unfinished."""
    port = Scheduler(w.config)
    shadow = Shadow(w.config, full_every=full_every)
    try:
        drive(port, shadow, workload(w.seed, w.requests), w.config.eos, abort_every=w.abort_every, max_steps=600)
    except ShadowDivergence as e:
        return f"divergence\n{e}"
    except Exception:  # the mutant broke the run: killed as a failing test would be
        return f"error\n{traceback.format_exc(limit=-4)}"
    if not port.is_finished():
        return "unfinished\nthe engine's scheduler still holds requests after 600 steps"
    return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="check_killer", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--check-full-every", type=int, default=FULL_EVERY, metavar="K",
                   help=f"steps between full comparisons (default {FULL_EVERY})")
    p.add_argument("--seed", type=int, default=0, help="the first workload seed (default 0)")
    args = p.parse_args(argv)
    if args.check_full_every < 1:
        p.error(f"--check-full-every must be at least 1, got {args.check_full_every}")
    count = 0
    for w in workloads(args.seed):
        why = judge(w, args.check_full_every)
        if why:
            kind, _, report = why.partition("\n")
            print(f"FAILED {w.name}:{kind}\n{report}")
            return 1
        count += 1
    print(f"{count} workloads passed check mode (check_full_every={args.check_full_every})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
