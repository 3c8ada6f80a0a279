"""The spec's figures: five small workloads, each recorded through the reference and drawn (TRACE-11).

Invariant: ``spec/figures/NAME.trace.jsonl`` is exactly what ``record_workload``
writes for ``FIGURES[NAME]`` with the current reference, and ``NAME.png`` is
drawn from it; tests/test_timeline.py checks the first, and
``scripts/figures.sh`` (``python -m optimized.trace.figures spec/figures``)
regenerates both. Every request ignores EOS and draws tokens 100, 101, ...,
so only the scheduler's rules shape the pictures.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optimized.verify.conformance import Workload, parse_workload


@dataclass(frozen=True)
class Figure:
    clause: str
    caption: str
    config: dict[str, int]
    requests: list[tuple[list[int], int, int]]  # (prompt, max_tokens, arrive)

    def workload(self) -> Workload:
        requests: list[dict[str, Any]] = [
            {"id": i, "prompt": prompt, "max_tokens": n, "ignore_eos": True, "arrive": arrive,
             "output": [100 + k for k in range(n)]}
            for i, (prompt, n, arrive) in enumerate(self.requests)]
        return parse_workload({"config": self.config, "requests": requests})


def _config(num_blocks: int, max_num_batched_tokens: int = 64) -> dict[str, int]:
    return {"block_size": 4, "num_blocks": num_blocks, "max_num_seqs": 4,
            "max_num_batched_tokens": max_num_batched_tokens, "eos": 0}


def _tokens(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


SHARED = _tokens(1, 12)
FIGURES = {
    "chunked-prefill": Figure(
        "CHUNK-1", "A 22-token prompt under an 8-token budget is prefilled in chunks of 8, 8 and 6; request 1 waits "
        "behind it (only the first of a batch may be chunked) and is prefilled alone once the chunk is done, "
        "while request 0 sits running but unscheduled.",
        _config(32, 8), [(_tokens(1, 22), 4, 0), (_tokens(40, 6), 4, 0)]),
    "preemption": Figure(
        "PREEMPT-2", "Four 7-token prompts fill 8 of 10 blocks. At the first decode step that opens a block, "
        "requests 0 and 1 take the last two; request 2 needs one more, so the newest, request 3, is preempted "
        "(discard and recompute). It waits at the head of the queue and is prefilled again, from the prefix cache "
        "where its released blocks still hold their hash.",
        _config(10), [(_tokens(10 * i + 1, 7), 6, 0) for i in range(4)]),
    "head-of-line-blocking": Figure(
        "EDGE-3", "Request 1 (24 tokens, 6 blocks) cannot get its blocks while request 0 runs; request 2 (3 tokens, "
        "1 block) would fit but waits behind it, because the prefill scan stops at the head of the queue.",
        _config(10), [(_tokens(1, 20), 10, 0), (_tokens(30, 24), 3, 1), (_tokens(60, 3), 3, 2)]),
    "empty-decode": Figure(
        "EDGE-2", "Request 0 (7 tokens + 3) needs 3 blocks of a 2-block cache: at its second decode step it needs a "
        "block, preempts itself, and the decode batch is empty: the lesson's assert fires (ADMIT-1 refuses such "
        "a request at the door).",
        _config(2), [(_tokens(1, 7), 3, 0), (_tokens(20, 2), 2, 0)]),
    "prefix-cache-hit": Figure(
        "CACHE-5", "Three prompts open with the same 12 tokens. Request 1 arrives while request 0 runs and shares its "
        "3 full blocks (a hit on used blocks: 3 tokens computed); request 2 arrives after both finished and revives "
        "the freed blocks, still cached (CACHE-3): it computes 1 token, since the last block is never taken from "
        "the cache (CACHE-4).",
        _config(16), [([*SHARED, 50, 51], 3, 0), ([*SHARED, 60, 61, 62], 3, 1), ([*SHARED, 70], 3, 9)]),
}


def write_figures(folder: Path) -> list[Path]:
    """Record every figure's workload through the reference and draw it; the paths written."""
    from optimized.trace.schema import read_trace
    from optimized.trace.timeline import build_timeline, png
    from optimized.trace.workload import record_workload

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, figure in FIGURES.items():
        text = record_workload(figure.workload())
        trace_path, png_path = folder / f"{name}.trace.jsonl", folder / f"{name}.png"
        trace_path.write_text(text, encoding="utf-8")
        timeline = build_timeline(read_trace(text.encode().splitlines(keepends=True)))
        png(timeline, str(png_path), title=f"{name} ({figure.clause})")
        written += [trace_path, png_path]
    return written


if __name__ == "__main__":
    for path in write_figures(Path(sys.argv[1] if len(sys.argv) > 1 else "spec/figures")):
        print(path)
