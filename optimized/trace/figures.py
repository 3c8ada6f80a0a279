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
    clause: str  # the clause it illustrates, beside which spec/ shows it
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
# What each shows is said beside it in spec/ (TRACE-11) and checked by tests/test_timeline.py.
FIGURES = {
    # A 22-token prompt under an 8-token budget, prefilled in chunks of 8, 8 and 6; request 1 waits behind it.
    "chunked-prefill": Figure("CHUNK-1", _config(32, 8), [(_tokens(1, 22), 4, 0), (_tokens(40, 6), 4, 0)]),
    # Four 7-token prompts fill 8 of 10 blocks; the first decode step that opens a block preempts request 3.
    "preemption": Figure("PREEMPT-2", _config(10), [(_tokens(10 * i + 1, 7), 6, 0) for i in range(4)]),
    # Request 1 (6 blocks) cannot start while request 0 runs; request 2 (1 block) would fit but waits behind it.
    "head-of-line-blocking": Figure(
        "EDGE-3", _config(10), [(_tokens(1, 20), 10, 0), (_tokens(30, 24), 3, 1), (_tokens(60, 3), 3, 2)]),
    # Request 0 needs 3 blocks of a 2-block cache: its second decode step preempts itself, the batch is empty.
    "empty-decode": Figure("EDGE-2", _config(2), [(_tokens(1, 7), 3, 0), (_tokens(20, 2), 2, 0)]),
    # Three prompts open with the same 12 tokens: a hit on used blocks, then on freed blocks still cached.
    "prefix-cache-hit": Figure(
        "CACHE-5", _config(16), [([*SHARED, 50, 51], 3, 0), ([*SHARED, 60, 61, 62], 3, 1), ([*SHARED, 70], 3, 9)]),
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
