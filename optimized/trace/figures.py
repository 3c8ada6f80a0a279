"""The spec's figures: small workloads, each recorded through the reference and drawn (TRACE-11).

Invariant: ``spec/figures/NAME.trace.jsonl`` is exactly what ``record_workload``
writes for ``FIGURES[NAME]`` with the current reference, and every PNG is
drawn from it (``NAME.png``; with ``tables``, also ``NAME-tables.png`` and
``NAME-blocks.png``); tests/test_timeline.py checks the first, and
``scripts/figures.sh`` (``python -m optimized.trace.figures spec/figures``)
regenerates them all, with ``schedule-flowchart.png``, drawn from ``FLOW``.
Every request ignores EOS and draws tokens 100, 101, ..., so only the
scheduler's rules shape the pictures.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optimized.trace.schema import Request, Trace
from optimized.verify.conformance import Workload, parse_workload

Marks = list[tuple[int, str]]  # (step, what happens there): a dashed line and a label on the picture


def _no_marks(trace: Trace) -> Marks:
    return []


@dataclass(frozen=True)
class Figure:
    clause: str  # the clause it illustrates, beside which spec/ shows it
    config: dict[str, Any]
    requests: list[tuple[list[int], int, int]]  # (prompt, max_tokens, arrive)
    marks: Callable[[Trace], Marks] = _no_marks  # the decisive steps, found in the trace
    tables: bool = False  # also draw its block tables and the life of each block

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


def _prompt_lengths(trace: Trace) -> dict[int, int]:
    return {e.id: len(e.prompt) for e in trace.events if isinstance(e, Request)}


def _first_preemption(trace: Trace) -> Marks:
    step = next(s for s in trace.steps if s.preempted)
    return [(step.step, f"request {step.preempted[-1]} preempted: the newest (PREEMPT-2)")]


def _chunk_blocks_the_rest(trace: Trace) -> Marks:
    """The first prefill step that leaves budget unused while a request that needs more waits behind it."""
    budget, lengths = trace.config["max_num_batched_tokens"], _prompt_lengths(trace)
    for s in trace.steps:
        left = budget - sum(n for _, n, _ in s.batch)
        behind = [i for i in lengths if i > s.batch[-1][0]]  # all arrive at step 0 in this figure
        if s.prefill and left > 0 and behind and lengths[behind[0]] > left:
            return [(s.step, f"{left} tokens of budget left; request {behind[0]} needs {lengths[behind[0]]} "
                             "and is not first: it waits (CHUNK-1)")]
    return []


def _head_blocks(trace: Trace) -> Marks:
    step = next(s for s in trace.steps if not s.prefill and len(_prompt_lengths(trace)) > 2
                and all(i != 2 for i, *_ in s.batch) and s.step >= 2)
    return [(step.step, "request 2 would fit, but waits behind request 1 (EDGE-3)")]


def _empty(trace: Trace) -> Marks:
    return [(s.step, "empty decode (EDGE-2)") for s in trace.steps if s.empty_decode]


def _hits(trace: Trace) -> Marks:
    lengths = _prompt_lengths(trace)
    return [(s.step, f"request {rid}: {lengths[rid] - n} tokens from the cache (CACHE-5)")
            for s in trace.steps if s.prefill for rid, n, _ in s.batch if rid > 0 and n < lengths[rid]
            and not any(rid in p.preempted for p in trace.steps if p.step < s.step)]


def _long_prompt_stalls(trace: Trace) -> Marks:
    lengths = _prompt_lengths(trace)
    step = next(s for s in trace.steps if s.prefill and s.batch[0][1] < lengths[s.batch[0][0]])
    return [(step.step, f"{lengths[step.batch[0][0]]}-token prompt: chunks until done, no decode between (CHUNK-2)")]


def _walkthrough(trace: Trace) -> Marks:
    preempt = _first_preemption(trace)
    again = next(s for s in trace.steps if s.step > preempt[0][0] and s.prefill)
    return [*_hits(trace), (preempt[0][0], "request 2 preempted"), (again.step, "request 2 recomputed")]


SHARED = _tokens(1, 12)
# What each shows is said beside it in spec/ (TRACE-11) and checked by tests/test_timeline.py.
FIGURES = {
    # A 22-token prompt under an 8-token budget, prefilled in chunks of 8, 8 and 6; request 1 waits behind it.
    "chunked-prefill": Figure("CHUNK-1", _config(32, 8), [(_tokens(1, 22), 4, 0), (_tokens(40, 6), 4, 0)],
                              _chunk_blocks_the_rest),
    # Two short requests decode; a 22-token prompt arrives under an 8-token budget: both stall for its 3 chunks.
    "long-prompt-arrives": Figure("CHUNK-2", _config(32, 8),
                                  [(_tokens(1, 3), 8, 0), (_tokens(10, 3), 8, 0), (_tokens(20, 22), 2, 2)],
                                  _long_prompt_stalls),
    # Four 7-token prompts fill 8 of 10 blocks; the first decode step that opens a block preempts request 3.
    "preemption": Figure("PREEMPT-2", _config(10), [(_tokens(10 * i + 1, 7), 6, 0) for i in range(4)],
                         _first_preemption),
    # Request 1 (6 blocks) cannot start while request 0 runs; request 2 (1 block) would fit but waits behind it.
    "head-of-line-blocking": Figure(
        "EDGE-3", _config(10), [(_tokens(1, 20), 10, 0), (_tokens(30, 24), 3, 1), (_tokens(60, 3), 3, 2)],
        _head_blocks),
    # Request 0 needs 3 blocks of a 2-block cache: its second decode step preempts itself, the batch is empty.
    "empty-decode": Figure("EDGE-2", _config(2), [(_tokens(1, 7), 3, 0), (_tokens(20, 2), 2, 0)], _empty),
    # Three prompts open with the same 12 tokens: a hit on used blocks, then on freed blocks still cached.
    "prefix-cache-hit": Figure(
        "CACHE-5", _config(16), [([*SHARED, 50, 51], 3, 0), ([*SHARED, 60, 61, 62], 3, 1), ([*SHARED, 70], 3, 9)],
        _hits, tables=True),
    # spec/primer.md's worked example, in an 8-block cache: a prefill, a prefix hit on two used blocks, decode
    # steps that open blocks, a preemption, an eviction, and the recompute that revives what is left.
    "worked-example": Figure(
        "LEARN-1", _config(8), [([*_tokens(1, 8), 21, 22], 7, 0), ([*_tokens(1, 8), 31, 32, 33], 7, 1),
                             (_tokens(40, 7), 5, 2)], _walkthrough, tables=True),
}


# --- the schedule() flowchart ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Node:
    text: str
    clause: str  # where spec/ states the rule
    code: str  # the reference's condition or statement, verbatim (tests/test_timeline.py checks it is there)
    at: tuple[float, float]
    decision: bool = True


FLOW = {
    "seqs": Node("waiting not empty and\nbatch < max_num_seqs?", "PREFILL-2",
                 "while self.waiting and len(scheduled_seqs) < self.max_num_seqs:", (0, 9)),
    "budget": Node("budget left?\n(remaining > 0)", "PREFILL-3", "if remaining == 0:", (0, 7.6)),
    "blocks": Node("fresh: can_allocate != -1?\n(prefix hits counted)", "PREFILL-4", "if num_cached_blocks == -1:",
                   (0, 6.2)),
    "chunk": Node("needs more than remaining\nand batch not empty?", "CHUNK-1",
                  "if remaining < num_tokens and scheduled_seqs:", (0, 4.8)),
    "take": Node("allocate; grant min(needed, remaining);\nprefill done? -> running", "PREFILL-5",
                 "seq.num_scheduled_tokens = min(num_tokens, remaining)", (0, 3.4), decision=False),
    "stop": Node("break: stop the scan;\nall behind it wait too", "PREFILL-2", "break", (2.3, 5.5),
                 decision=False),
    "any": Node("prefill batch\nnot empty?", "SCHED-2", "if scheduled_seqs:", (4.2, 9)),
    "prefill": Node("return (batch, prefill)", "SCHED-1", "return scheduled_seqs, True", (8.2, 9), decision=False),
    "decode": Node("running not empty and\nbatch < max_num_seqs?", "DECODE-1",
                   "while self.running and len(scheduled_seqs) < self.max_num_seqs:", (4.2, 7.2)),
    "room": Node("can_append(head)?", "DECODE-2", "while not self.block_manager.can_append(seq):", (4.2, 5.4)),
    "others": Node("another sequence\nrunning?", "DECODE-2", "if self.running:", (7.0, 5.4)),
    "victim": Node("preempt the newest\n(the back of running)", "PREEMPT-2", "self.preempt(self.running.pop())",
                   (7.0, 3.6), decision=False),
    "itself": Node("preempt itself;\nit is not scheduled", "DECODE-2", "self.preempt(seq)", (9.3, 5.4),
                   decision=False),
    "append": Node("1 token; may_append", "DECODE-1", "seq.num_scheduled_tokens = 1", (4.2, 3.6), decision=False),
    "back": Node("batch back to the front\nof running; return", "DECODE-3",
                 "self.running.extendleft(reversed(scheduled_seqs))", (8.2, 7.2), decision=False),
}
EDGES = [("seqs", "budget", "yes"), ("seqs", "any", "no"), ("budget", "blocks", "yes"), ("budget", "stop", "no"),
         ("blocks", "chunk", "yes"), ("blocks", "stop", "no"), ("chunk", "stop", "yes"), ("chunk", "take", "no"),
         ("stop", "any", ""),
         ("take", "seqs", "next"), ("any", "prefill", "yes"), ("any", "decode", "no"), ("decode", "room", "yes"),
         ("decode", "back", "no"), ("room", "append", "yes"), ("room", "others", "no"), ("others", "victim", "yes"),
         ("others", "itself", "no"), ("victim", "room", "retry"), ("itself", "decode", "next"),
         ("append", "decode", "next")]


def draw_flowchart(path: Path) -> None:
    """``schedule()`` as boxes (diamonds: decisions), each naming the clause that states it."""
    from optimized.trace.timeline import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(12, 8))
    ax.set_xlim(-2.4, 10.4)
    ax.set_ylim(2.4, 10.2)
    ax.axis("off")
    boxes = {}
    for name, node in FLOW.items():
        style = "round4,pad=0.4" if node.decision else "round,pad=0.4"
        colour = "#fff2cc" if node.decision else "#dbe8f5"
        boxes[name] = ax.text(*node.at, f"{node.text}\n[{node.clause}]", ha="center", va="center", fontsize=8.5,
                              zorder=2, bbox={"boxstyle": style, "fc": colour, "ec": "#333333", "lw": 0.8})
    fig.canvas.draw()  # lays the boxes out, so that each arrow stops at its box's edge
    for source, target, label in EDGES:
        (x0, y0), (x1, y1) = FLOW[source].at, FLOW[target].at
        bend = "arc3,rad=0.35" if label in ("next", "retry") else "arc3,rad=0"
        ax.annotate("", (x1, y1), (x0, y0), zorder=3, arrowprops={
            "arrowstyle": "-|>", "color": "#555555", "lw": 1.1, "connectionstyle": bend, "mutation_scale": 14,
            "patchA": boxes[source].get_bbox_patch(), "patchB": boxes[target].get_bbox_patch(),
            "shrinkA": 1, "shrinkB": 1})
        if label != "next":  # a loop's way back needs no word
            lift = 0.75 if label == "retry" else 0.08
            ax.text(x0 + (x1 - x0) * 0.45 + 0.08, y0 + (y1 - y0) * 0.45 + lift, label, fontsize=8, color="#444444")
    ax.text(-2.3, 10.0, "prefill loop (from the head of waiting, in order)", fontsize=9, weight="bold")
    ax.text(3.0, 10.0, "decode loop (only if no prefill fitted)", fontsize=9, weight="bold")
    ax.set_title("schedule(): one decision per step (reference/scheduler.py, Scheduler.schedule)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_figures(folder: Path) -> list[Path]:
    """Record every figure's workload through the reference and draw it; the paths written."""
    from optimized.trace.schema import read_trace
    from optimized.trace.tables import draw_block_life, draw_block_tables
    from optimized.trace.timeline import build_timeline, png
    from optimized.trace.workload import record_workload

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, figure in FIGURES.items():
        text = record_workload(figure.workload())
        trace_path, png_path = folder / f"{name}.trace.jsonl", folder / f"{name}.png"
        trace_path.write_text(text, encoding="utf-8")
        trace = read_trace(text.encode().splitlines(keepends=True))
        timeline = build_timeline(trace, detail=figure.tables)
        png(timeline, str(png_path), title=f"{name} ({figure.clause})", marks=figure.marks(trace))
        written += [trace_path, png_path]
        if figure.tables:
            written += [folder / f"{name}-tables.png", folder / f"{name}-blocks.png"]
            draw_block_tables(timeline, str(written[-2]), f"{name}: block tables")
            draw_block_life(timeline, str(written[-1]), f"{name}: the life of each block")
    written.append(folder / "schedule-flowchart.png")
    draw_flowchart(written[-1])
    return written


if __name__ == "__main__":
    for path in write_figures(Path(sys.argv[1] if len(sys.argv) > 1 else "spec/figures")):
        print(path)
