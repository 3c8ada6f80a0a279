"""The cost of one all-reduce between tensor-parallel ranks, alone: ``python -m optimized.parallel.comm_bench``.

Two processes (this one and one spawned, each on one thread) join a gloo group the way the engine does and
all-reduce float32 tensors of the sizes a decoder step sends (tokens x hidden), many times; the median time per
all-reduce is printed with the bytes. Nothing else runs meanwhile, so unlike the engine's own counters
(``nanoverify bench throughput --tensor-parallel-size 2``) the figure holds no skew between the ranks' compute.
The figures recorded in spec/parallel.md (TP-10) come from this.
"""

from __future__ import annotations

import multiprocessing
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from optimized.parallel.group import Group, open_store, private_store

HIDDEN = 256  # the default model's hidden size
TOKENS = (1, 16, 64, 256, 1024)
REPEATS = 200


def _timings(store: Any, rank: int, hidden: int) -> list[float]:
    """This rank's median seconds per all-reduce at each size in TOKENS."""
    torch.set_num_threads(1)
    group = Group(store, rank, 2, torch.device("cpu"))
    medians = []
    for tokens in TOKENS:
        t = torch.ones(tokens, hidden)
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            group.all_reduce(t)
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    return medians


def _worker(folder: str, hidden: int) -> None:
    _timings(open_store(Path(folder)), 1, hidden)


def main(hidden: int = HIDDEN) -> None:
    store, folder = private_store()
    try:
        proc = multiprocessing.get_context("spawn").Process(target=_worker, args=(str(folder), hidden))
        proc.start()
        medians = _timings(store, 0, hidden)
        proc.join()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"gloo all-reduce between 2 processes on this machine, float32 [tokens, {hidden}], median of {REPEATS}:")
    for tokens, seconds in zip(TOKENS, medians, strict=True):
        size = tokens * hidden * 4
        print(f"  {tokens:5d} tokens  {size / 1024:8.1f} KiB  {seconds * 1e6:8.1f} us  "
              f"{size / seconds / 1e9:6.2f} GB/s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else HIDDEN)
