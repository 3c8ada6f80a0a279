"""Block-level pictures of a detailed timeline (``build_timeline(..., detail=True)``): which request holds which
block ids at each step, and what each block is at each step (TRACE-11).

Invariant: every id and state drawn is read off the reference during the replay (``Frame.tables``,
``Frame.blocks``); nothing is inferred from the trace's records.
"""

from __future__ import annotations

from typing import Any

from optimized.trace.timeline import BLOCK_STATES, COLOURS, Timeline, pyplot

BLOCK_COLOURS = {"free": "#ffffff", "cached": "#d8e4f0", "held": "#4a78a8", "shared": "#7b3fa0", "hit": "#2a9d8f",
                 "evicted": "#cc2936"}
BLOCK_LABELS = {"free": "free (no hash)", "cached": "free, still cached (hash kept)", "held": "held by one table",
                "shared": "shared (ref_count > 1)", "hit": "revived by a prefix hit",
                "evicted": "taken fresh: its hash forgotten"}


def shared_ids(timeline: Timeline, k: int) -> set[int]:
    """The block ids that more than one table holds in frame ``k``."""
    seen: set[int] = set()
    twice: set[int] = set()
    for table in timeline.frames[k].tables.values():
        twice |= seen & set(table)
        seen |= set(table)
    return twice


def idle_gaps(timeline: Timeline) -> list[int]:
    """The frame indices k whose step does not follow frame k - 1's: idle steps (nothing ran) lie between them."""
    frames = timeline.frames
    return [k for k in range(1, len(frames)) if frames[k].step != frames[k - 1].step + 1]


def _grid(plt: Any, rows: int, columns: int, width: float) -> tuple[Any, Any]:
    fig, ax = plt.subplots(figsize=(width, 1.4 + 0.42 * rows))
    ax.set_xlim(0, columns)
    ax.set_ylim(rows, 0)
    return fig, ax


def _finish(plt: Any, fig: Any, ax: Any, handles: list[Any], timeline: Timeline, title: str, path: str) -> None:
    """The legend right of the grid, the title with the cache's settings, the file written."""
    from matplotlib.lines import Line2D

    if idle_gaps(timeline):
        handles = [*handles, Line2D([], [], color="black", linewidth=2.5, label="idle steps left out")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(f"{title}; block_size {timeline.config.get('block_size')}, num_blocks {timeline.num_blocks}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_block_tables(timeline: Timeline, path: str, title: str) -> None:
    """Steps down, requests across (narrow enough to read in a chapter's column); each cell the request's block
    table in the step, entry j in the same place at every step, shared ids in bold purple, the cell shaded by the
    request's state."""
    plt = pyplot()
    from matplotlib.patches import Patch, Rectangle

    frames, requests = timeline.frames, timeline.requests
    slots = max([len(t) for f in frames for t in f.tables.values()] or [1])  # table entry j in the j-th slot
    fig, ax = _grid(plt, len(frames), len(requests), 1.7 * len(requests) + 4.2)
    for k, frame in enumerate(frames):
        shared = shared_ids(timeline, k)
        for r, rid in enumerate(requests):
            state = frame.states.get(rid)
            if state is not None:
                ax.add_patch(Rectangle((r, k), 1, 1, fc=COLOURS[state], alpha=0.35, ec="white"))
            table = frame.tables.get(rid, [])
            for j, block in enumerate(table):
                x = r + (j + 0.5) / slots
                ax.text(x, k + 0.5, str(block), ha="center", va="center", fontsize=9,
                        color=BLOCK_COLOURS["shared"] if block in shared else "black",
                        weight="bold" if block in shared else "normal")
    for k in idle_gaps(timeline):  # a thick line where idle steps were left out
        ax.axhline(k, color="black", linewidth=2.5)
    ax.set_yticks([k + 0.5 for k in range(len(frames))], [f"step {f.step}" for f in frames], fontsize=8)
    ax.set_xticks([r + 0.5 for r in range(len(requests))], [f"request {rid}" for rid in requests], fontsize=8)
    ax.xaxis.tick_top()
    handles = [Patch(color=COLOURS[s], alpha=0.35, label=s) for s in ("chunk", "prefill", "decode", "stalled",
                                                                      "preempted", "waiting")]
    handles.append(Patch(color=BLOCK_COLOURS["shared"], label="bold id: held by several tables"))
    _finish(plt, fig, ax, handles, timeline,
            f"{title}\nblock ids in table order (block i holds tokens i*block_size ..)", path)


def draw_block_life(timeline: Timeline, path: str, title: str) -> None:
    """Blocks down, steps across, coloured by BLOCK_STATES; a held block names the requests holding it."""
    plt = pyplot()
    from matplotlib.patches import Patch, Rectangle

    frames = timeline.frames
    fig, ax = _grid(plt, timeline.num_blocks, len(frames), max(8.0, 0.8 * len(frames) + 3.0))
    for k, frame in enumerate(frames):
        holders: dict[int, list[int]] = {}
        for rid, table in frame.tables.items():
            for block in table:
                holders.setdefault(block, []).append(rid)
        for block, state in enumerate(frame.blocks):
            ax.add_patch(Rectangle((k, block), 1, 1, fc=BLOCK_COLOURS[state], ec="#bbbbbb", lw=0.5))
            if block in holders:
                ax.text(k + 0.5, block + 0.5, ",".join(map(str, holders[block])), ha="center", va="center",
                        fontsize=7, color="white")
    for k in idle_gaps(timeline):  # a thick line where idle steps were left out
        ax.axvline(k, color="black", linewidth=2.5)
    ax.set_xticks([k + 0.5 for k in range(len(frames))], [str(f.step) for f in frames], fontsize=8)
    ax.set_yticks([b + 0.5 for b in range(timeline.num_blocks)], [f"block {b}" for b in range(timeline.num_blocks)],
                  fontsize=7)
    ax.set_xlabel("step (read right after its schedule(); the number in a held block: the requests holding it)")
    handles = [Patch(fc=BLOCK_COLOURS[s], ec="#999999", label=BLOCK_LABELS[s]) for s in BLOCK_STATES]
    _finish(plt, fig, ax, handles, timeline,
            f"{title}\nfree -> held -> free but cached -> revived by a hit, or taken fresh (evicted)", path)
