"""Who got the GPU, who waited: a trace drawn as a Perfetto timeline and as a PNG (TRACE-9, TRACE-10).

Invariant: what is drawn is what the reference scheduler does when the trace
is replayed through it (``replay_trace``), observed after each step: a
request's state in a step is read off the scheduler, never guessed from the
records, and a trace that stops replaying identically is drawn only up to the
step before its first difference (``Timeline.difference`` says so). Each live
request is in exactly one state per step: ``waiting`` (queued, never run or
not yet readmitted), ``chunk`` (a prefill grant that left its prompt
unfinished), ``prefill`` (the grant that finished it), ``decode``, ``stalled``
(running, but not in this step's batch: a prefill step ran instead) or
``preempted`` (sent back to waiting by this or an earlier step, until it is
scheduled again). The Perfetto output is Chrome's trace-event JSON: complete
(``X``) slices on one track per request, which never overlap, instants (``i``)
where a request finishes, is aborted or fails, and counter (``C``) tracks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from optimized.core.port import SchedulerPort
from optimized.trace.replay import replay_trace
from optimized.trace.schema import Aborted, Request, Step, Trace

STATES = ("waiting", "chunk", "prefill", "decode", "stalled", "preempted")
LABELS = {"waiting": "waiting", "chunk": "prefill chunk", "prefill": "prefill", "decode": "decoding",
          "stalled": "running, not scheduled", "preempted": "preempted"}
COLOURS = {"waiting": "#c9c9c9", "chunk": "#f6b26b", "prefill": "#e06c00", "decode": "#3c8d3c",
           "stalled": "#a8d5a2", "preempted": "#cc2936"}
STEP_US = 1000  # a step drawn on the step axis lasts 1 ms
MAX_ROWS = 128  # the PNG draws at most this many request rows; past it, every k-th request
# A block in a step (read right after schedule()): never hashed and free, free but still hashed (a prompt may hit
# it), held by one table, held by several; "hit": held, taken from the free-but-cached state by a prefix hit;
# "evicted": held, taken fresh from the free-but-cached state (its hash forgotten).
BLOCK_STATES = ("free", "cached", "held", "shared", "hit", "evicted")


@dataclass
class Frame:
    """One step as the reference ran it, observed after its postprocess."""

    step: int
    start: float  # seconds on the chosen axis
    end: float
    states: dict[int, str]  # live request id -> its state in this step
    granted: dict[int, int]  # request id -> tokens scheduled this step
    used: int  # KV blocks held while the step ran (right after its schedule())
    free: int
    free_cached: int  # free blocks still holding a hash (a later prompt may hit them)
    running: int
    waiting: int
    ended: dict[int, str] = field(default_factory=dict)  # request id -> "finished" / "failed" in this step
    after: tuple[int, int, int] = (0, 0, 0)  # (used, free, free_cached) after its postprocess: what an idle gap holds
    tables: dict[int, list[int]] = field(default_factory=dict)  # with detail: each live request's blocks in the step
    blocks: list[str] = field(default_factory=list)  # with detail: each block's BLOCK_STATES entry in the step

    @property
    def tokens(self) -> int:
        return sum(self.granted.values())

    @property
    def batch_size(self) -> int:
        return len(self.granted)


@dataclass
class Timeline:
    frames: list[Frame]
    requests: list[int]  # every request id, in arrival order
    num_blocks: int
    aborts: list[tuple[int, float]]  # (request id, axis time of the abort)
    axis: str  # "steps" or "wall"
    difference: str | None = None  # why the drawing stops early, if it does
    empty_decode: int | None = None  # the step at which the trace ends in the empty decode (EDGE-2), if it does
    config: dict[str, Any] = field(default_factory=dict)  # the trace's scheduler configuration


class _Observer:
    def __init__(self, trace: Trace, wall: bool, detail: bool = False) -> None:
        self.trace = trace
        self.wall = wall
        self.detail = detail
        self.tables: dict[int, list[int]] = {}  # seq_id -> table, right after schedule() (with detail)
        self.block_states: list[str] = []
        self.cached_after: set[int] = set()  # free-but-cached blocks after the last postprocess (with detail)
        self.frames: list[Frame] = []
        self.preempted: set[int] = set()
        self.running: set[int] = set()
        self.blocks = (0, 0, 0)
        self.counts = CacheCounts()

    def scheduled(self, scheduler: SchedulerPort[Any]) -> None:
        self.blocks = self.counts.look(scheduler)
        if self.detail:
            self.tables = {s.seq_id: list(s.block_table) for s in (*scheduler.running, *scheduler.waiting)}
            self.block_states = [self._block_state(scheduler.blocks, b) for b in range(scheduler.blocks.num_blocks)]

    def _block_state(self, blocks: Any, block_id: int) -> str:
        if not blocks.is_used(block_id):
            return "free" if blocks.block_hash(block_id) == -1 else "cached"
        if block_id in self.cached_after:
            return "hit" if blocks.block_hash(block_id) != -1 else "evicted"
        return "shared" if blocks.ref_count(block_id) > 1 else "held"

    def stepped(self, record: Step, scheduler: SchedulerPort[Any], batch: list[Any], id_of: dict[int, int]) -> None:
        waiting = [id_of[s.seq_id] for s in scheduler.waiting]
        running = [id_of[s.seq_id] for s in scheduler.running]
        granted = {i: n for i, n, _ in record.batch}
        # The empty decode's record names nobody; whoever ran before and waits now preempted itself there.
        now_preempted = self.running & set(waiting) if record.empty_decode else set(record.preempted)
        self.preempted = (self.preempted | now_preempted) - set(granted)
        self.running = set(running)
        states = {i: "preempted" if i in self.preempted else "waiting" for i in waiting}
        states.update((i, "stalled") for i in running)
        for i in granted:
            states[i] = "decode" if not record.prefill else "chunk" if i in waiting else "prefill"
        ended = {i: "finished" for i in record.finished}
        if record.failed is not None:
            ended = dict.fromkeys(granted, "failed")
        start, end = self._span(record)
        # The empty decode runs nothing: the cache as its schedule() left it.
        after = self.counts.look(scheduler)  # the held blocks re-read once per step, so none is missed
        used, free, cached = after if record.empty_decode else self.blocks
        tables = {id_of[k]: t for k, t in self.tables.items() if t} if self.detail else {}
        self.frames.append(Frame(record.step, start, end, states, granted, used, free, cached, len(running),
                                 len(waiting), ended, after, tables, self.block_states))
        if self.detail:
            blocks = scheduler.blocks
            self.cached_after = {b for b in range(blocks.num_blocks)
                                 if not blocks.is_used(b) and blocks.block_hash(b) != -1}

    def _span(self, record: Step) -> tuple[float, float]:
        if self.wall and record.wall is not None:
            return record.wall
        return float(record.step), float(record.step + 1)


class CacheCounts:
    """Used, free and free-but-cached block counts of a scheduler, kept without a scan of the cache.

    A block changes between free and used, or gains or loses its hash, only while some live sequence's table holds
    it (allocation puts a block in a table, release takes it out of one, hashes are set on held blocks). So at each
    look only the blocks held now or at the last look are re-read (through the port's ``BlockReader``), and the
    free-but-cached set stays exact.
    """

    def __init__(self) -> None:
        self.free_cached: set[int] = set()
        self.last_held: set[int] = set()

    def look(self, scheduler: SchedulerPort[Any]) -> tuple[int, int, int]:
        blocks = scheduler.blocks
        held = {b for s in (*scheduler.running, *scheduler.waiting) for b in s.block_table}
        for block_id in held | self.last_held:
            if not blocks.is_used(block_id) and blocks.block_hash(block_id) != -1:
                self.free_cached.add(block_id)
            else:
                self.free_cached.discard(block_id)
        self.last_held = held
        free = blocks.num_free
        return blocks.num_blocks - free, free, len(self.free_cached)


def build_timeline(trace: Trace, axis: str = "steps", detail: bool = False) -> Timeline:
    """Replay ``trace`` through the reference and observe every step; ``axis`` 'wall' needs recorded wall times.
    ``detail`` also records each step's block tables and every block's state (a scan of the cache per step: for
    the spec's small figures)."""
    if axis not in ("steps", "wall"):
        raise ValueError(f"axis must be 'steps' or 'wall', got {axis!r}")
    if axis == "wall" and any(s.wall is None for s in trace.steps):
        raise ValueError("axis 'wall' needs a trace recorded with wall times (--trace-wall-times)")
    observer = _Observer(trace, axis == "wall", detail)
    outcome = replay_trace(trace, "reference", observer)
    requests = [e.id for e in trace.events if isinstance(e, Request)]
    starts = {f.step: f.start for f in observer.frames}
    aborts = [(e.id, starts.get(e.before, observer.frames[-1].end if observer.frames else 0.0))
              for e in trace.events if isinstance(e, Aborted)]
    empty = next((s.step for s in trace.steps if s.empty_decode), None)
    return Timeline(observer.frames, requests, trace.config["num_blocks"], aborts, axis, outcome.difference, empty,
                    dict(trace.config))


# --- Perfetto / Chrome trace-event JSON -------------------------------------------------------------------
REQUESTS_PID, SCHEDULER_PID = 1, 2


def _us(seconds_or_steps: float, axis: str) -> float:
    return round(seconds_or_steps * (1e6 if axis == "wall" else STEP_US), 3)


def _runs(timeline: Timeline, rid: int) -> Iterable[tuple[str, int, int]]:
    """(state, first frame index, last frame index) stretches of one request; each chunk step its own stretch."""
    current: tuple[str, int, int] | None = None
    for k, frame in enumerate(timeline.frames):
        state = frame.states.get(rid)
        if current is not None and (state != current[0] or state == "chunk" or k != current[2] + 1):
            yield current
            current = None
        if state is None:
            continue
        current = (state, current[1] if current else k, k)
    if current is not None:
        yield current


def track_ids(timeline: Timeline) -> dict[int, int]:
    """Each request's thread id: its arrival order + 1 (a request id may be any int64, past what a viewer's
    32-bit thread ids hold; the id itself is in the track's name)."""
    return {rid: order + 1 for order, rid in enumerate(timeline.requests)}


def perfetto(timeline: Timeline) -> dict[str, Any]:
    """The timeline as a trace-event JSON object (opens in ui.perfetto.dev and chrome://tracing)."""
    axis, frames = timeline.axis, timeline.frames
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": REQUESTS_PID, "tid": 0, "args": {"name": "requests"}},
        {"ph": "M", "name": "process_name", "pid": SCHEDULER_PID, "tid": 0, "args": {"name": "scheduler"}},
    ]
    tid_of = track_ids(timeline)
    for order, rid in enumerate(timeline.requests):
        tid = tid_of[rid]
        events.append({"ph": "M", "name": "thread_name", "pid": REQUESTS_PID, "tid": tid,
                       "args": {"name": f"request {rid}"}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": REQUESTS_PID, "tid": tid,
                       "args": {"sort_index": order}})
        for state, first, last in _runs(timeline, rid):
            ts = _us(frames[first].start, axis)
            args: dict[str, Any] = {"steps": [frames[first].step, frames[last].step]}
            if state == "chunk":
                args["tokens"] = frames[first].granted[rid]
            events.append({"ph": "X", "name": LABELS[state], "cat": state, "pid": REQUESTS_PID, "tid": tid,
                           "ts": ts, "dur": max(_us(frames[last].end, axis) - ts, 0.0), "args": args})
    for frame in frames:
        for rid, how in frame.ended.items():
            events.append({"ph": "i", "s": "t", "name": how, "pid": REQUESTS_PID, "tid": tid_of[rid],
                           "ts": _us(frame.end, axis), "args": {"step": frame.step}})
        events += _counters(frame, axis)
    events += [{"ph": "i", "s": "t", "name": "aborted", "pid": REQUESTS_PID, "tid": tid_of[rid], "ts": _us(t, axis),
                "args": {}} for rid, t in timeline.aborts]
    other = {"axis": "1 ms per scheduler step" if axis == "steps" else "wall time",
             "num_blocks": timeline.num_blocks}
    if timeline.difference is not None:
        other["stopped_early"] = timeline.difference
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _counters(frame: Frame, axis: str) -> list[dict[str, Any]]:
    ts = _us(frame.start, axis)
    series = {
        "KV blocks": {"used": frame.used, "free": frame.free - frame.free_cached, "free, cached": frame.free_cached},
        "queues": {"running": frame.running, "waiting": frame.waiting},
        "tokens per step": {"tokens": frame.tokens},
    }
    return [{"ph": "C", "name": name, "pid": SCHEDULER_PID, "tid": 0, "ts": ts, "args": args}
            for name, args in series.items()]


# --- PNG ---------------------------------------------------------------------------------------------------
def require_matplotlib() -> None:
    """ValueError naming the ``plot`` extra when matplotlib is not installed (TRACE-10)."""
    _matplotlib()


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend; ValueError naming the ``plot`` extra without it."""
    return _matplotlib()


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--format png needs matplotlib: install the plot extra (pip install 'nanoverify[plot]'); "
                         "--format perfetto needs nothing") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def shown_rows(requests: list[int], limit: int = MAX_ROWS) -> tuple[list[int], int]:
    """The requests drawn as rows, and the stride (1: all of them; k: every k-th, in arrival order)."""
    stride = max(1, math.ceil(len(requests) / limit))
    return requests[::stride], stride


def ordinal(n: int) -> str:
    """2 -> '2nd', 3 -> '3rd', 11 -> '11th'."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def png(timeline: Timeline, path: str, title: str = "", marks: Iterable[tuple[int, str]] = ()) -> None:
    """Requests down, steps across, coloured by state; KV blocks and batch size, then tokens per step against the
    budget, underneath on the same axis. ``marks``: (step, words) drawn as a line at that step's start."""
    plt = _matplotlib()
    from matplotlib.colors import ListedColormap
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    frames = timeline.frames
    rows, stride = shown_rows(timeline.requests)
    columns, edges = _columns(frames)
    index = {s: k + 1 for k, s in enumerate(STATES)}
    grid = [[index.get(f.states.get(rid, ""), 0) if f is not None else 0 for f in columns] for rid in rows]
    height = 2.2 + min(len(rows), MAX_ROWS) * 0.06
    fig, (top, bottom, budget) = plt.subplots(3, 1, sharex=True, figsize=(11, height + 4.0),
                                              gridspec_kw={"height_ratios": [height, 2.2, 1.5]})
    cmap = ListedColormap(["#ffffff", *(COLOURS[s] for s in STATES)])
    small = len(frames) <= 60 and len(rows) <= 24
    top.pcolormesh(edges, range(len(rows) + 1), grid or [[0]], cmap=cmap, vmin=0, vmax=len(STATES),
                   shading="flat", edgecolors="white" if small else "face", linewidth=0.5 if small else 0)
    if small:
        _label_grants(top, timeline, rows)
    _mark_ends(top, timeline, rows)
    top.set_ylim(len(rows), 0)
    step_label = "step" if timeline.axis == "steps" else "seconds"
    top.set_ylabel("request" if stride == 1 else f"request (every {ordinal(stride)})")
    ticks = list(range(0, len(rows), max(1, len(rows) // 16)))
    top.set_yticks([t + 0.5 for t in ticks], [str(rows[t]) for t in ticks], fontsize=7)
    handles: list[Any] = [Patch(color=COLOURS[s], label=LABELS[s]) for s in STATES]
    handles += [Line2D([], [], marker=m, color=c, linestyle="", label=how) for how, (m, c) in ENDS.items()]
    top.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    note = f"{len(timeline.requests)} requests" if stride == 1 else (
        f"showing every {ordinal(stride)} of {len(timeline.requests)} requests ({len(rows)} rows)")
    if timeline.difference is not None:
        note += f"; stopped early: {timeline.difference}"
    if timeline.empty_decode is not None:
        note += f"; step {timeline.empty_decode} is the empty decode (EDGE-2): the run stops there"
    if timeline.config:
        note += "\n" + config_line(timeline.config)
    top.set_title(f"{title}\n{note}" if title else note, fontsize=9)
    _usage(bottom, timeline)
    _tokens(budget, timeline)
    marks = list(marks)
    budget.set_xlabel("\n".join([step_label, *(f"[{k}] step {step}: {words}"
                                                for k, (step, words) in enumerate(marks, 1))]), fontsize=9)
    if timeline.axis == "steps":
        from matplotlib.ticker import MaxNLocator

        budget.xaxis.set_major_locator(MaxNLocator(integer=True))
    starts = {f.step: f.start for f in frames}
    for k, (step, _) in enumerate(marks, 1):
        for ax in (top, bottom, budget):
            ax.axvline(starts[step], color="black", linestyle="--", linewidth=1.2, zorder=4)
        top.annotate(f"[{k}]", (starts[step], len(rows)), xytext=(3, 3), textcoords="offset points", fontsize=8,
                     va="bottom", ha="left", weight="bold", zorder=5,
                     bbox={"boxstyle": "round,pad=0.2", "fc": "#fff8c4", "ec": "black", "lw": 0.6})
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _columns(frames: list[Frame]) -> tuple[list[Frame | None], list[float]]:
    """The picture's columns (None: an idle stretch between two steps, nothing queued) and their edges."""
    if not frames:
        return [None], [0.0, 1.0]
    columns: list[Frame | None] = []
    edges = [frames[0].start]
    for frame in frames:
        if frame.start > edges[-1]:
            columns.append(None)
            edges.append(frame.start)
        columns.append(frame)
        edges.append(frame.end)
    return columns, edges


def _label_grants(ax: Any, timeline: Timeline, rows: list[int]) -> None:
    """On a small picture: each prefill cell says how many tokens it computed (prefix-cache hits excluded)."""
    for k, rid in enumerate(rows):
        for frame in timeline.frames:
            if frame.states.get(rid) in ("chunk", "prefill"):
                ax.text((frame.start + frame.end) / 2, k + 0.5, str(frame.granted[rid]), ha="center", va="center",
                        fontsize=7)


ENDS = {"finished": ("|", "black"), "failed": ("x", "#cc2936"), "aborted": ("x", "black")}


def _mark_ends(ax: Any, timeline: Timeline, rows: list[int]) -> None:
    """A tick where a request finished, a cross where it failed (red) or was aborted (black)."""
    row_of = {rid: k for k, rid in enumerate(rows)}
    points: dict[str, tuple[list[float], list[float]]] = {how: ([], []) for how in ENDS}
    ends = [(rid, frame.end, how) for frame in timeline.frames for rid, how in frame.ended.items()]
    for rid, at, how in [*ends, *((rid, at, "aborted") for rid, at in timeline.aborts)]:
        if rid in row_of:
            points[how][0].append(at)
            points[how][1].append(row_of[rid] + 0.5)
    for how, (xs, ys) in points.items():
        marker, colour = ENDS[how]
        ax.scatter(xs, ys, marker=marker, color=colour, s=40, linewidths=1.5, zorder=3)


def config_line(config: dict[str, Any]) -> str:
    """The settings a figure's reader needs, in one line."""
    return (f"block_size {config['block_size']}, num_blocks {config['num_blocks']}, "
            f"budget (max_num_batched_tokens) {config['max_num_batched_tokens']}, "
            f"max_num_seqs {config['max_num_seqs']}, policy {_policy(config)}")


def _policy(config: dict[str, Any]) -> str:
    policy = str(config.get("policy", "lesson"))
    return f"{policy} (patience {config.get('patience')})" if policy == "lpm" else policy


@dataclass
class Usage:
    """What the PNG's lower panels draw, one value per column (``edges`` has one more)."""

    edges: list[float]
    used: list[int]
    used_and_cached: list[int]
    batch: list[int]
    tokens: list[int]


def usage(timeline: Timeline) -> Usage:
    """An idle column (nothing ran between two steps) holds the cache as the step before it left it: after that
    step's postprocess, which released the blocks of whatever finished there."""
    columns, edges = _columns(timeline.frames)
    used: list[int] = []
    cached: list[int] = []
    for k, column in enumerate(columns):
        before = columns[k - 1] if k > 0 else None
        if column is not None:
            held, free_cached = column.used, column.free_cached
        elif before is not None:
            held, _, free_cached = before.after
        else:
            held, free_cached = 0, 0
        used.append(held)
        cached.append(held + free_cached)
    return Usage(edges, used, cached, [0 if c is None else c.batch_size for c in columns],
                 [0 if c is None else c.tokens for c in columns])


def _tokens(ax: Any, timeline: Timeline) -> None:
    drawn = usage(timeline)
    ax.stairs(drawn.tokens, drawn.edges, fill=True, color="#e8a15c", label="tokens computed")
    top = max([*drawn.tokens, 1])
    if "max_num_batched_tokens" in timeline.config:
        limit = timeline.config["max_num_batched_tokens"]
        ax.axhline(limit, color="black", linestyle=":", linewidth=1, label=f"budget {limit}")
        top = max(top, limit)
    ax.set_ylim(0, top * 1.2)
    ax.set_ylabel("tokens")
    ax.legend(loc="upper left", bbox_to_anchor=(1.06, 1.0), fontsize=8, frameon=False)


def _usage(ax: Any, timeline: Timeline) -> None:
    drawn = usage(timeline)
    edges, used, cached, batch = drawn.edges, drawn.used, drawn.used_and_cached, drawn.batch
    ax.stairs(cached, edges, fill=True, color="#d8e4f0", label="KV blocks used + free-but-cached")
    ax.stairs(used, edges, fill=True, color="#4a78a8", label="KV blocks used")
    ax.axhline(timeline.num_blocks, color="#4a78a8", linestyle=":", linewidth=1,
               label=f"num_blocks {timeline.num_blocks}")
    ax.set_ylabel("KV blocks")
    ax.set_ylim(0, timeline.num_blocks * 1.05)
    twin = ax.twinx()
    twin.stairs(batch, edges, color="#e06c00", linewidth=1.5, label="batch size")
    twin.set_ylabel("batch size")
    twin.set_ylim(0, max([*batch, 1]) * 1.15)
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", bbox_to_anchor=(1.06, 1.0), fontsize=8,
              frameon=False)
