"""Draw (spec/trace.md TRACE-8..11): Perfetto trace events that are valid and whose slices never overlap on a
track, a PNG readable at 256 requests, a clear error without matplotlib, workloads drawn through the reference, and
the spec's figures that are what the current reference produces."""

from __future__ import annotations

import io
import itertools
import json
import re
import sys
from collections import defaultdict
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

import reference
from optimized.cli import main
from optimized.trace.figures import EDGES, FIGURES, FLOW, Figure
from optimized.trace.recorder import Recorder
from optimized.trace.replay import replay_trace
from optimized.trace.schema import Request, Trace, read_trace
from optimized.trace.tables import shared_ids
from optimized.trace.timeline import build_timeline, ordinal, perfetto, png, shown_rows, track_ids, usage
from optimized.trace.workload import record_workload, workload_trace
from optimized.verify.conformance import parse_workload
from reference.extensions import abort, abort_step

ROOT = Path(__file__).resolve().parent.parent
FIGURE_DIR = ROOT / "spec" / "figures"


def shipped(index: int) -> dict[str, Any]:
    text = resources.files("optimized.verify").joinpath("data/conformance.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()][index]  # type: ignore[no-any-return]


def text_trace(text: str) -> Trace:
    return read_trace(text.encode().splitlines(keepends=True))


def run_with_abort_and_failure() -> Trace:
    """A run recorded by hand on the reference: three requests, an abort between steps, a failed step."""
    config = reference.SchedulerConfig(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    sched, out = reference.Scheduler(config), io.StringIO()
    rec = Recorder(out, config, wall_times=True)
    seqs = {}
    for rid, prompt in enumerate(([1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14])):
        seqs[rid] = reference.Sequence(prompt, reference.SamplingParams(max_tokens=5, ignore_eos=True), 4)
        sched.add(seqs[rid])
        rec.add(rid, prompt, 5, True)
    ids = {s.seq_id: rid for rid, s in seqs.items()}

    def step(fail: bool = False) -> None:
        batch, prefill = sched.schedule()
        decided = rec.decided(prefill, [(ids[s.seq_id], s.num_scheduled_tokens, s.block_table) for s in batch], [])
        if fail:
            abort_step(sched, batch)
            rec.failed(decided, "RuntimeError: injected")
            return
        sched.postprocess(batch, [50] * len(batch), prefill)
        rec.step(decided, [50] * len(batch), [ids[s.seq_id] for s in batch if s.status.name == "FINISHED"])

    step()
    step()
    abort(sched, seqs[1])
    rec.abort(1)
    step(fail=True)
    return text_trace(out.getvalue())


REQUIRED = {"X": {"name", "cat", "ph", "ts", "dur", "pid", "tid"}, "C": {"name", "ph", "ts", "pid", "args"},
            "M": {"name", "ph", "pid", "args"}, "i": {"name", "ph", "ts", "pid", "tid", "s"}}


def check_trace_events(doc: dict[str, Any]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """Every event of a trace-event JSON document well-formed; the complete slices of each track, in time order,
    never overlapping."""
    doc = json.loads(json.dumps(doc))  # what a viewer reads
    assert isinstance(doc["traceEvents"], list) and doc["displayTimeUnit"] in ("ms", "ns")
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for event in doc["traceEvents"]:
        missing = REQUIRED[event["ph"]] - set(event)
        assert not missing, (event, missing)
        # Viewers hold process and thread ids in 32 bits.
        assert all(0 <= event.get(key, 0) < 1 << 31 for key in ("pid", "tid")), event
        if event["ph"] == "X":
            assert event["dur"] >= 0 and event["ts"] >= 0
            tracks[(event["pid"], event["tid"])].append(event)
        elif event["ph"] == "C":
            assert event["args"] and all(isinstance(v, int) and v >= 0 for v in event["args"].values())
        elif event["ph"] == "i":
            assert event["s"] in ("g", "p", "t")
        else:
            assert event["name"] in ("process_name", "thread_name", "thread_sort_index")
    for slices in tracks.values():
        slices.sort(key=lambda e: e["ts"])
        for before, after in itertools.pairwise(slices):
            assert before["ts"] + before["dur"] <= after["ts"] + 1e-6, (before, after)
    return tracks


@pytest.mark.clause("TRACE-9")
@pytest.mark.parametrize("source", ["sample-0", "sample-62", "sample-70", "abort-and-failure", *FIGURES])
def test_perfetto_events_are_valid_and_slices_do_not_overlap(source: str) -> None:
    """TRACE-9: required fields per phase, slices on a track never overlap, one track per request, and each live
    step of a request is covered by exactly one slice of the state it was in."""
    if source.startswith("sample-"):
        trace = workload_trace(parse_workload(shipped(int(source[7:]))["workload"]))
    elif source in FIGURES:
        trace = workload_trace(FIGURES[source].workload())
    else:
        trace = run_with_abort_and_failure()
    timeline = build_timeline(trace)
    doc = perfetto(timeline)
    tracks = check_trace_events(doc)
    assert timeline.difference is None
    tid_of = track_ids(timeline)
    for rid in timeline.requests:
        steps = sorted(s for e in tracks.get((1, tid_of[rid]), []) for s in range(e["args"]["steps"][0],
                                                                               e["args"]["steps"][1] + 1))
        assert steps == [f.step for f in timeline.frames if rid in f.states]
    chunk_slices = sum(e["cat"] == "chunk" for slices in tracks.values() for e in slices)
    chunks = sum(1 for s in trace.steps if s.prefill for rid, n, _ in s.batch
                 if any(f.step == s.step and f.states.get(rid) == "chunk" for f in timeline.frames))
    assert chunk_slices == chunks
    preempted = {rid for s in trace.steps for rid in s.preempted}
    rid_of = {tid: rid for rid, tid in tid_of.items()}
    assert preempted <= {rid_of[e["tid"]] for slices in tracks.values() for e in slices if e["cat"] == "preempted"}
    counters = {e["name"] for e in doc["traceEvents"] if e["ph"] == "C"}
    assert counters == {"KV blocks", "queues", "tokens per step"}


@pytest.mark.clause("TRACE-9")
def test_counters_add_up_to_the_cache() -> None:
    """TRACE-9: at every step the KV counter's used, free and free-but-cached blocks sum to num_blocks, and tokens
    per step is the batch's grant."""
    trace = workload_trace(FIGURES["prefix-cache-hit"].workload())
    doc = perfetto(build_timeline(trace))
    kv = [e["args"] for e in doc["traceEvents"] if e["ph"] == "C" and e["name"] == "KV blocks"]
    assert kv and all(sum(a.values()) == trace.config["num_blocks"] for a in kv)
    assert any(a["free, cached"] for a in kv)
    tokens = [e["args"]["tokens"] for e in doc["traceEvents"] if e["ph"] == "C" and e["name"] == "tokens per step"]
    assert tokens == [sum(n for _, n, _ in s.batch) for s in trace.steps]


@pytest.mark.clause("TRACE-7", "TRACE-9")
def test_the_wall_axis_uses_recorded_times() -> None:
    """TRACE-7: a trace with wall times draws in seconds; one without refuses the wall axis by name."""
    trace = run_with_abort_and_failure()
    timeline = build_timeline(trace, "wall")
    assert [(f.start, f.end) for f in timeline.frames] == [s.wall for s in trace.steps]
    check_trace_events(perfetto(timeline))
    with pytest.raises(ValueError, match="axis 'wall' needs a trace recorded with wall times"):
        build_timeline(workload_trace(FIGURES["preemption"].workload()), "wall")


def big_workload(n: int) -> dict[str, Any]:
    requests = [{"id": i, "prompt": [1 + i % 50, 2, 3, 4 + i % 7][: 1 + i % 4], "max_tokens": 1 + i % 5,
                 "ignore_eos": True, "arrive": i // 16, "output": [7] * 5} for i in range(n)]
    return {"config": {"block_size": 4, "num_blocks": 64, "max_num_seqs": 32, "max_num_batched_tokens": 64,
                       "eos": 0}, "requests": requests}


@pytest.mark.clause("TRACE-10")
def test_png_at_256_requests_samples_rows_and_says_so(tmp_path: Path) -> None:
    """TRACE-10: past MAX_ROWS the PNG draws every k-th request and its title says so."""
    rows, stride = shown_rows(list(range(256)))
    assert (len(rows), stride, rows[:3]) == (128, 2, [0, 2, 4])
    assert shown_rows(list(range(100))) == (list(range(100)), 1)
    timeline = build_timeline(workload_trace(parse_workload(big_workload(256))))
    path = tmp_path / "big.png"
    titles: list[str] = []
    import matplotlib.axes

    real = matplotlib.axes.Axes.set_title

    def spy(self: Any, label: str, *args: Any, **kwargs: Any) -> Any:
        titles.append(label)
        return real(self, label, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matplotlib.axes.Axes, "set_title", spy)
        png(timeline, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert titles == ["showing every 2nd of 256 requests (128 rows)\nblock_size 4, num_blocks 64, "
                      "budget (max_num_batched_tokens) 64, max_num_seqs 32, policy lesson"]
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st"]


@pytest.mark.clause("TRACE-8", "TRACE-10")
def test_timeline_command_draws_a_workload_and_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """TRACE-8: a conformance workload is run through the reference first; both files are written beside each
    other; a trace draws the same as the workload it was recorded from."""
    workloads = tmp_path / "w.jsonl"
    workloads.write_text("\n".join(json.dumps(shipped(i)) for i in (3, 70)) + "\n")
    assert main(["timeline", str(workloads), "--index", "1", "-o", str(tmp_path / "a")]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "a.json"), str(tmp_path / "a.png")]
    trace = tmp_path / "t.jsonl"
    trace.write_text(record_workload(parse_workload(shipped(70)["workload"])))
    assert main(["timeline", str(trace), "--format", "perfetto"]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "t.timeline.json")]
    assert json.loads((tmp_path / "a.json").read_text()) == json.loads((tmp_path / "t.timeline.json").read_text())
    assert main(["timeline", str(workloads), "--index", "2"]) == 2
    assert "--index 2: the input holds 2 workloads" in capsys.readouterr().err


@pytest.mark.clause("TRACE-10")
def test_png_without_matplotlib_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """TRACE-10: --format png (or both) without matplotlib is one line naming the plot extra, nothing written;
    --format perfetto needs nothing."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(record_workload(FIGURES["preemption"].workload()))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    for fmt in ("png", "both"):
        assert main(["timeline", str(trace), "--format", fmt, "-o", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert "nanoverify[plot]" in err and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == [trace]
    assert main(["timeline", str(trace), "--format", "perfetto", "-o", str(tmp_path / "x")]) == 0
    assert (tmp_path / "x.json").exists()


@pytest.mark.clause("TRACE-11")
@pytest.mark.parametrize("name", list(FIGURES))
def test_the_spec_figures_are_what_the_reference_does(name: str) -> None:
    """TRACE-11: each committed figure trace is what the current reference records for its workload, replays
    identically through both schedulers, shows what its clause is about, and is drawn beside its trace and
    referenced from spec/trace.md."""
    figure = FIGURES[name]
    committed = (FIGURE_DIR / f"{name}.trace.jsonl").read_text(encoding="utf-8")
    assert record_workload(figure.workload()) == committed, "stale figure: run scripts/figures.sh"
    trace = text_trace(committed)
    for impl in ("reference", "optimized"):
        assert replay_trace(trace, impl).ok
    assert (FIGURE_DIR / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert f"figures/{name}.png" in (ROOT / "spec" / "trace.md").read_text(encoding="utf-8")
    assert f"](figures/{name}.png)" in defining_chapter(figure.clause), "the figure sits beside its clause"
    frames = build_timeline(trace).frames
    states = {s for f in frames for s in f.states.values()}
    shows = {"chunked-prefill": "chunk" in states, "preemption": "preempted" in states,
             "head-of-line-blocking": _blocked_behind_the_head(trace),
             "empty-decode": trace.steps[-1].empty_decode, "prefix-cache-hit": _hit(trace),
             "long-prompt-arrives": any(f.states.get(2) == "chunk" and f.states.get(0) == f.states.get(1) == "stalled"
                                        for f in frames),
             "worked-example": _hit(trace) and "preempted" in states}
    assert shows[name]


def defining_chapter(clause: str) -> str:
    """The text of the one spec chapter that defines ``clause`` (``**ID**``)."""
    chapters = [p.read_text(encoding="utf-8") for p in sorted((ROOT / "spec").glob("*.md"))]
    defining = [text for text in chapters if re.search(rf"\*\*{clause}\*\*", text)]
    assert len(defining) == 1, clause
    return defining[0]


def _blocked_behind_the_head(trace: Trace) -> bool:
    """A request that would fit on its own waits while decode steps run (EDGE-3)."""
    prefill = {s.step: s.prefill for s in trace.steps}
    return any(f.states.get(2) == "waiting" and not prefill[f.step] for f in build_timeline(trace).frames)


def _hit(trace: Trace) -> bool:
    """A prefill granted fewer tokens than its prompt holds, all at once: the rest came from the cache."""
    prompts = {e.id: len(e.prompt) for e in trace.events if isinstance(e, Request)}
    return any(s.prefill and n < prompts[rid] and rid > 0 for s in trace.steps for rid, n, _ in s.batch)


@pytest.mark.clause("TRACE-9")
def test_a_trace_that_stops_replaying_is_drawn_up_to_its_first_difference(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """TRACE-9: the picture ends before the first difference, and the command warns, naming it."""
    lines = record_workload(FIGURES["preemption"].workload()).splitlines(keepends=True)
    k = next(i for i, line in enumerate(lines) if json.loads(line).get("step") == 3)
    record = json.loads(lines[k])
    record["batch"][0][2:] = [2, [9]]  # a version-2 entry [id, tokens, kept, added]: the third block 9, not 8
    lines[k] = json.dumps(record) + "\n"
    timeline = build_timeline(text_trace("".join(lines)))
    assert [f.step for f in timeline.frames] == [0, 1, 2]
    assert timeline.difference is not None and timeline.difference.startswith("step 3: batch[0]")
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(lines))
    assert main(["timeline", str(path), "--format", "perfetto"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("nanoverify timeline: warning: drawn up to the first difference from the reference (step 3")
    assert json.loads((tmp_path / "bad.timeline.json").read_text())["otherData"]["stopped_early"].startswith("step 3")


@pytest.mark.clause("TRACE-9")
def test_timeline_garbage_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """TRACE-9: a missing file, a folder, garbage bytes, a bad flag or a wall axis without wall times: exit 2, one
    line on standard error, nothing written."""
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(b'{"version": 1, "config": \xff}\n')
    figure = tmp_path / "figure.jsonl"
    figure.write_text(record_workload(FIGURES["preemption"].workload()))
    written = {garbage, figure}
    for args in ([str(tmp_path / "missing")], [str(tmp_path)], [str(garbage)], [str(figure), "--format", "svg"],
                 [str(figure), "--axis", "wall"], [str(figure), "--index", "-1"], [str(figure), "--nope"]):
        assert main(["timeline", *args]) == 2, args
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and err.startswith("nanoverify timeline: "), (args, err)
    assert set(tmp_path.iterdir()) == written


@pytest.mark.clause("TRACE-4", "TRACE-9")
def test_timeline_says_when_the_last_line_was_cut_short(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """TRACE-4: a trace whose last line a crash cut short is drawn from the lines before it, with the warning the
    replay prints."""
    text = record_workload(FIGURES["preemption"].workload()).encode()
    cut = tmp_path / "crashed.jsonl"
    cut.write_bytes(text[: len(text) - 20])
    truncated = read_trace(cut.read_bytes().splitlines(keepends=True)).truncated
    assert truncated is not None
    assert main(["timeline", str(cut), "--format", "perfetto"]) == 0
    assert capsys.readouterr().err.splitlines() == [f"nanoverify timeline: warning: {truncated}"]


@pytest.mark.clause("TRACE-9")
def test_a_request_id_past_32_bits_keeps_its_track_id_small() -> None:
    """TRACE-9: a track's thread id is its request's arrival order + 1, whatever the request id (any int64); the id
    itself names the track."""
    big = (1 << 63) - 1
    config = {"block_size": 4, "num_blocks": 8, "max_num_seqs": 2, "max_num_batched_tokens": 8, "eos": 0}
    records = [{"version": 1, "config": config},
               {"add": {"id": big, "prompt": [1, 2, 3], "max_tokens": 1, "ignore_eos": True, "arrive": 0}},
               {"add": {"id": 5, "prompt": [4, 5], "max_tokens": 1, "ignore_eos": True, "arrive": 0}},
               {"step": 0, "prefill": True, "batch": [[big, 3, [0]], [5, 2, [1]]], "preempted": [], "tokens": [9, 9],
                "finished": [big, 5]}]
    doc = perfetto(build_timeline(text_trace("".join(json.dumps(r) + "\n" for r in records))))
    check_trace_events(doc)
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names == {1: f"request {big}", 2: "request 5"}


def grants(trace: Trace, rid: int, prefill: bool = True) -> list[int]:
    """The tokens request ``rid`` was granted in each prefill (or decode) step, in order."""
    return [n for s in trace.steps if s.prefill == prefill for i, n, _ in s.batch if i == rid]


@pytest.mark.clause("TRACE-11")
def test_each_figure_shows_what_its_caption_says() -> None:
    """TRACE-11: the facts spec/trace.md states of each figure, read off its committed trace and its drawing."""
    traces = {name: text_trace((FIGURE_DIR / f"{name}.trace.jsonl").read_text()) for name in FIGURES}
    chunked = traces["chunked-prefill"]
    assert grants(chunked, 0) == [8, 8, 6] and [s.batch[0][0] for s in chunked.steps if s.prefill] == [0, 0, 0, 1]
    assert [len(s.batch) for s in chunked.steps if s.prefill] == [1, 1, 1, 1]  # request 1 prefilled alone
    states = [f.states for f in build_timeline(chunked).frames]
    assert [s[1] for s in states[:3]] == ["waiting"] * 3 and states[3][0] == "stalled"

    preemption = traces["preemption"]
    first = preemption.steps[0]
    assert [n for _, n, _ in first.batch] == [7] * 4 and sum(len(t) for *_, t in first.batch) == 8
    assert preemption.config["num_blocks"] == 10
    opening = next(s for s in preemption.steps if s.preempted)
    assert opening.preempted == [3] and [i for i, *_ in opening.batch] == [0, 1, 2]
    assert grants(preemption, 3) == [7, 7 + 2 - 4]  # recomputed: its 9 tokens less the one block still cached

    blocked = traces["head-of-line-blocking"]
    prompts = {e.id: len(e.prompt) for e in blocked.events if isinstance(e, Request)}
    assert (prompts[1], prompts[2]) == (24, 3) and _blocked_behind_the_head(blocked)
    free = [blocked.config["num_blocks"] - len(t) for s in blocked.steps if not s.prefill for i, _, t in s.batch
            if i == 0]
    assert all(1 <= f < 6 for f in free)  # room for request 2's one block, never for request 1's six

    empty = traces["empty-decode"]
    assert [s.prefill for s in empty.steps[:-1]] == [True, False] and empty.steps[-1].empty_decode  # 2nd decode

    hit = traces["prefix-cache-hit"]
    assert grants(hit, 1) == [3] and grants(hit, 2) == [1]
    assert hit.steps[1].batch[0][2][:3] == hit.steps[0].batch[0][2][:3]  # request 1 shares request 0's 3 blocks
    both_done = next(s.step for s in hit.steps if {0, 1} <= set(s.finished))
    revived = next(s for s in hit.steps if s.batch[0][0] == 2)  # after both finished, their freed blocks again
    assert revived.step > both_done and revived.batch[0][2][:3] == hit.steps[0].batch[0][2][:3]


@pytest.mark.clause("TRACE-11")
def test_an_idle_gap_holds_the_cache_the_last_step_left() -> None:
    """TRACE-11: between steps 4 and 9 of prefix-cache-hit nothing runs; every block was released at step 3, so the
    gap shows no block used and the five hashed ones free but cached (it showed step 3's six used before)."""
    timeline = build_timeline(workload_trace(FIGURES["prefix-cache-hit"].workload()))
    drawn = usage(timeline)
    gap = drawn.edges.index(4.0)
    assert drawn.edges[gap + 1] == 9.0 and drawn.batch[gap] == 0
    assert (drawn.used[gap], drawn.used_and_cached[gap]) == (0, 5)
    assert (drawn.used[gap - 1], drawn.used[gap + 1]) == (6, 4)  # step 3 ran with 6; step 9 with 4
    # Whatever the trace, the gap is what the step before it left after its postprocess.
    for name in FIGURES:
        timeline = build_timeline(workload_trace(FIGURES[name].workload()))
        drawn, by_start = usage(timeline), {f.start: f for f in timeline.frames}
        for k in range(len(drawn.used)):
            if drawn.edges[k] not in by_start:
                before = timeline.frames[[f.end for f in timeline.frames].index(drawn.edges[k])]
                assert (drawn.used[k], drawn.used_and_cached[k]) == (before.after[0], before.after[0] + before.after[2])


MARKED = {"chunked-prefill": [2], "long-prompt-arrives": [2], "preemption": [2], "head-of-line-blocking": [2],
          "empty-decode": [2], "prefix-cache-hit": [1, 9], "worked-example": [1, 5, 9]}


@pytest.mark.clause("TRACE-11")
@pytest.mark.parametrize("name", list(FIGURES))
def test_each_figure_marks_its_decisive_step(name: str) -> None:
    """TRACE-11: the dashed lines stand where the caption says the thing happens, found in the trace: the first
    chunk, the first preemption, the first decode a fitting request waits through, the empty decode, each hit."""
    trace = workload_trace(FIGURES[name].workload())
    marks = FIGURES[name].marks(trace)
    assert [step for step, _ in marks] == MARKED[name]
    by_step = {s.step: s for s in trace.steps}
    for step, words in marks:
        record = by_step[step]
        if "preempted" in words:
            assert record.preempted
        if "from the cache" in words:
            assert record.prefill and any(n < len(e.prompt) for i, n, _ in record.batch for e in trace.events
                                          if isinstance(e, Request) and e.id == i)


@pytest.mark.clause("TRACE-11")
@pytest.mark.parametrize("name", [n for n, f in FIGURES.items() if f.tables])
def test_block_tables_and_block_states_are_read_off_the_reference(name: str) -> None:
    """TRACE-11: a detailed timeline's tables are the trace's recorded ones for every request in the batch; a
    block is held or shared exactly when some table holds it (shared: two or more), their count is the step's used
    count, a revived block had been free but cached and kept its hash, and an evicted one had been cached."""
    trace = workload_trace(FIGURES[name].workload())
    timeline = build_timeline(trace, detail=True)
    records = {s.step: s for s in trace.steps}
    for k, frame in enumerate(timeline.frames):
        for rid, _, table in records[frame.step].batch:
            assert frame.tables[rid] == list(table)
        holders = [b for table in frame.tables.values() for b in table]
        shared = shared_ids(timeline, k)
        assert {b for b in set(holders) if holders.count(b) > 1} == shared
        held = [b for b, s in enumerate(frame.blocks) if s in ("held", "shared", "hit", "evicted")]
        assert set(held) == set(holders) and len(held) == frame.used
        assert {b for b, s in enumerate(frame.blocks) if s == "shared"} <= shared
    seen = {s for f in timeline.frames for s in f.blocks}
    assert {"shared", "hit", "cached"} <= seen
    if name == "worked-example":  # spec/primer.md: block 5 evicted by request 1 at step 8, block 4 revived at 9
        blocks = {f.step: f.blocks for f in timeline.frames}
        assert (blocks[7][5], blocks[8][5], blocks[8][4], blocks[9][4]) == ("cached", "evicted", "cached", "hit")


@pytest.mark.clause("TRACE-11")
def test_the_flowchart_quotes_the_reference() -> None:
    """TRACE-11: each box of the schedule() flowchart quotes a statement reference/scheduler.py holds and names a
    clause spec/ defines; every edge joins two boxes; the drawing is committed."""
    source = (ROOT / "reference" / "scheduler.py").read_text(encoding="utf-8")
    for name, node in FLOW.items():
        assert node.code in source, name
        defining_chapter(node.clause)
    assert {n for edge in EDGES for n in edge[:2]} == set(FLOW)
    assert (FIGURE_DIR / "schedule-flowchart.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.clause("TRACE-11")
def test_every_figure_is_shown_with_its_caption_under_it() -> None:
    """TRACE-11: every PNG in spec/figures/ is shown by some chapter with a caption ("*Figure ...") on the line
    under it, and every picture a chapter shows exists."""
    chapters = {p.name: p.read_text(encoding="utf-8") for p in sorted((ROOT / "spec").glob("*.md"))}
    shown: set[str] = set()
    for chapter, text in chapters.items():
        lines = text.splitlines()
        for k, line in enumerate(lines):
            for picture in re.findall(r"!\[[^\]]*\]\(figures/([^)]+\.png)\)", line):
                assert (FIGURE_DIR / picture).exists(), (chapter, picture)
                assert k + 1 < len(lines) and lines[k + 1].startswith("*Figure"), (chapter, picture)
                shown.add(picture)
    # measured/ holds figures of measurements (spec/policies.md), not redrawn by the pipeline but shown all the same
    assert {p.relative_to(FIGURE_DIR).as_posix() for p in FIGURE_DIR.rglob("*.png")} == shown


@pytest.mark.clause("TRACE-11")
def test_the_flowchart_tells_preempting_another_from_preempting_itself() -> None:
    """TRACE-11: when can_append fails, the flowchart asks whether another sequence runs (DECODE-2): preempting the
    newest leads back to can_append, preempting itself to the decode loop's next sequence, as the reference's
    ``while ... else`` does (it drew one box for both, with a retry)."""
    node_of = {node.code: name for name, node in FLOW.items()}
    after = {source: [t for s, t, _ in EDGES if s == source] for source in FLOW}
    room, decode = node_of["while not self.block_manager.can_append(seq):"], node_of[
        "while self.running and len(scheduled_seqs) < self.max_num_seqs:"]
    others = node_of["if self.running:"]
    assert sorted(after[room]) == sorted(["append", others])
    assert after[node_of["self.preempt(self.running.pop())"]] == [room]
    assert after[node_of["self.preempt(seq)"]] == [decode]


@pytest.mark.clause("TRACE-11")
def test_the_committed_pictures_are_what_the_pipeline_draws(tmp_path: Path) -> None:
    """TRACE-11: every PNG in spec/figures/ is, pixel for pixel, what scripts/figures.sh draws now (a change to the
    drawing code without regenerating the figures fails here)."""
    import numpy as np
    from PIL import Image

    from optimized.trace.figures import write_figures

    drawn = [p for p in write_figures(tmp_path) if p.suffix == ".png"]
    assert {p.name for p in drawn} == {p.name for p in FIGURE_DIR.glob("*.png")}
    for path in drawn:
        with Image.open(path) as new, Image.open(FIGURE_DIR / path.name) as committed:
            assert new.size == committed.size and np.array_equal(np.asarray(new), np.asarray(committed)), (
                f"stale figure {path.name}: run scripts/figures.sh")


@pytest.mark.clause("TRACE-11")
def test_the_block_tables_stay_narrow_however_long_the_run(tmp_path: Path) -> None:
    """TRACE-11: the block-table picture grows down with the steps, not across (a chapter's column is about 700
    pixels: the 11-step worked example drawn 1,540 wide shrank its ids to a few pixels); entry j of a table stands in
    the same place at every step."""
    from PIL import Image

    from optimized.trace.tables import draw_block_tables

    long_run = Figure("LEARN-1", {**FIGURES["worked-example"].config, "num_blocks": 32}, [(list(range(1, 9)), 40, 0)])
    timeline = build_timeline(workload_trace(long_run.workload()), detail=True)
    assert len(timeline.frames) == 40
    draw_block_tables(timeline, str(tmp_path / "t.png"), "long")
    with Image.open(tmp_path / "t.png") as picture:
        width, height = picture.size
    assert width <= 800 < height


@pytest.mark.clause("TRACE-11")
def test_the_block_pictures_mark_where_idle_steps_were_left_out() -> None:
    """TRACE-11: the block pictures draw only the steps that ran, with a thick line where idle steps lie between
    two of them: prefix-cache-hit between steps 3 and 9, the worked example nowhere."""
    from optimized.trace.tables import idle_gaps

    def steps_either_side(name: str) -> list[tuple[int, int]]:
        timeline = build_timeline(workload_trace(FIGURES[name].workload()), detail=True)
        return [(timeline.frames[k - 1].step, timeline.frames[k].step) for k in idle_gaps(timeline)]

    assert steps_either_side("prefix-cache-hit") == [(3, 9)]
    assert steps_either_side("worked-example") == []
