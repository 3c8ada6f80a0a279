"""The cost of one all-reduce between tensor-parallel ranks, alone: ``python -m optimized.parallel.comm_bench``.

``--ranks`` processes (this one and the rest spawned, each on one thread) join a gloo group the way the engine does
and all-reduce float32 tensors of the sizes a decoder step sends (tokens x hidden), many times, gloo's all-reduce
and the batch-invariant mode's rank-order one (TP-11) in alternation; the median time of each per all-reduce is
printed with the bytes and their ratio. Nothing else runs meanwhile, so unlike the engine's own counters
(``nanoverify bench throughput --tensor-parallel-size 2``) the figures hold no skew between the ranks' compute.
The figures recorded in spec/parallel.md (TP-10, TP-11) come from this.
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from optimized.parallel.group import Group, open_store, private_store

HIDDEN = 256  # the default model's hidden size
TOKENS = (1, 16, 64, 256, 1024)
REPEATS = 200


def _timings(store: Any, rank: int, ranks: int, hidden: int, repeats: int) -> list[tuple[float, float]]:
    """This rank's median seconds per all-reduce at each size in TOKENS: (gloo's, in rank order), timed in turn."""
    torch.set_num_threads(1)
    group = Group(store, rank, ranks, torch.device("cpu"))
    medians = []
    for tokens in TOKENS:
        t = torch.ones(tokens, hidden)
        plain, ordered = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            group.all_reduce(t)
            middle = time.perf_counter()
            group.all_reduce_in_rank_order(t)
            ordered.append(time.perf_counter() - middle)
            plain.append(middle - start)
        medians.append((statistics.median(plain), statistics.median(ordered)))
    group.compute = group.control = None
    return medians


def _worker(folder: str, rank: int, ranks: int, hidden: int, repeats: int) -> None:
    _timings(open_store(Path(folder)), rank, ranks, hidden, repeats)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m optimized.parallel.comm_bench", description=__doc__)
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="the tensors' last dimension")
    parser.add_argument("--ranks", type=int, default=2, help="processes in the group (at least 2)")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="all-reduces of each kind per size")
    args = parser.parse_args(argv)
    if args.ranks < 2 or args.hidden < 1 or args.repeats < 1:
        parser.error("--ranks must be at least 2, --hidden and --repeats at least 1")
    store, folder = private_store()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(str(folder), rank, args.ranks, args.hidden, args.repeats))
             for rank in range(1, args.ranks)]
    try:
        for proc in procs:
            proc.start()
        medians = _timings(store, 0, args.ranks, args.hidden, args.repeats)
        for proc in procs:
            proc.join()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        shutil.rmtree(folder, ignore_errors=True)
    print(f"all-reduce between {args.ranks} processes on this machine, float32 [tokens, {args.hidden}], median of "
          f"{args.repeats} each, in alternation: gloo's, and in rank order (an all-gather, then the fixed-order sum)")
    for tokens, (plain, ordered) in zip(TOKENS, medians, strict=True):
        size = tokens * args.hidden * 4
        print(f"  {tokens:5d} tokens  {size / 1024:8.1f} KiB  gloo {plain * 1e6:8.1f} us ({size / plain / 1e9:5.2f} "
              f"GB/s)  in rank order {ordered * 1e6:8.1f} us  ratio {ordered / plain:5.2f}")


if __name__ == "__main__":
    main()
