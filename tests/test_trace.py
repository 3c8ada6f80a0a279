"""Record and replay (spec/trace.md): a run recorded with ``LLM(trace=...)`` replays identically through both
schedulers, whatever happened in it; a trace changed at one step is caught at that step; bad files are refused
by line and field, and a last line cut short is reported while everything before it replays."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optimized import LLM, SamplingParams
from optimized.cli import main
from optimized.core.port import SchedulerPort
from optimized.core.scheduler import Scheduler
from optimized.trace.figures import FIGURES
from optimized.trace.replay import replay_trace
from optimized.trace.schema import Step, Trace, TraceError, read_trace
from optimized.trace.workload import record_workload, workload_trace
from optimized.verify.reference_port import ReferencePort
from tests.engine_fixtures import make_llm

pytestmark = pytest.mark.usefixtures("engine_env")

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
SHARED = list(range(10, 22))  # three 4-token blocks: later prompts opening with it hit the prefix cache
make = partial(make_llm, num_kvcache_blocks=12, max_num_batched_tokens=10, max_num_seqs=4)


class ModelFault(RuntimeError):
    pass


def fail_call(monkeypatch: pytest.MonkeyPatch, llm: LLM, k: int) -> None:
    """The runner's k-th call (1-based) raises."""
    real, calls = llm.engine.runner.run, [0]

    def run(seqs: Sequence[Any], is_prefill: bool, draws: Sequence[Any]) -> list[int]:
        calls[0] += 1
        if calls[0] == k:
            raise ModelFault(f"injected on call {k}")
        tokens: list[int] = real(seqs, is_prefill, draws)
        return tokens

    monkeypatch.setattr(llm.engine.runner, "run", run)


def drain(llm: LLM) -> None:
    while llm.has_unfinished_requests():
        with contextlib.suppress(ModelFault):
            llm.step()


def eventful_run(path: Path, monkeypatch: pytest.MonkeyPatch, wall_times: bool = False) -> LLM:
    """A checked run (the shadow agrees at every step) with prefix hits, chunks, preemption, an abort, a stop
    cut and a failed step, recorded in ``path``."""
    llm = make(trace=path, trace_wall_times=wall_times)
    first = llm.generate([[*SHARED, 1, 2], [*SHARED, 3]], GREEDY, use_tqdm=False)[0]
    stop_at = first.token_ids[2]  # request 2 draws this token third: a stop token cuts it there
    llm.add_request([*SHARED, 1, 2], SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=(stop_at,)))
    doomed = llm.add_request(list(range(40, 47)), GREEDY)
    llm.step()
    llm.abort(doomed)
    fail_call(monkeypatch, llm, 10)  # a decode after the preemption fails its batch
    for p in ([5, 6, 7, 8, 9, 10, 11, 12, 13], [60, 61, 62, 63, 64], list(range(70, 79)), [90, 91, 92]):
        llm.add_request(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    drain(llm)
    return llm


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("trace") / "run.jsonl"
    with pytest.MonkeyPatch.context() as mp:
        llm = eventful_run(path, mp)
    return path, llm.engine.stats


def load(path: Path) -> Trace:
    return read_trace(path.read_bytes().splitlines(keepends=True))


def replay_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], list[str]]:
    code = main(["replay", *argv])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


@pytest.mark.clause("TRACE-1", "TRACE-2", "TRACE-3", "TRACE-5")
def test_an_eventful_run_replays_identically_through_both(recorded: tuple[Path, Any]) -> None:
    """TRACE-1..3, TRACE-5: the run had every kind of event, and each scheduler reproduces every step."""
    path, stats = recorded
    trace = load(path)
    steps = trace.steps
    assert stats.prefix_cache_hit_tokens > 0 and stats.chunked_prefills > 0 and stats.preemptions > 0
    assert any(s.preempted for s in steps) and any(s.failed for s in steps)
    assert len(steps) == stats.steps + stats.failed_steps == stats.compared_steps + 1
    assert [s.step for s in steps] == list(range(len(steps)))  # 0, 1, 2, ...: the failed step has its number
    assert {type(e).__name__ for e in trace.events} == {"Request", "Aborted", "Step"}
    assert list(trace.cuts.values()) == [3]  # the stop cut: max_tokens lowered to the three tokens drawn
    assert trace.config["num_blocks"] == 12 and trace.truncated is None
    for impl in ("reference", "optimized"):
        outcome = replay_trace(trace, impl)
        assert (outcome.identical, outcome.steps, outcome.difference) == (len(steps), len(steps), None)


@pytest.mark.clause("TRACE-6")
def test_replay_command_says_identical(recorded: tuple[Path, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """TRACE-6: `nanoverify replay --impl NAME TRACE` prints identical: N/N steps and exits 0."""
    n = len(load(recorded[0]).steps)
    for impl in ("reference", "optimized"):
        assert replay_cli(capsys, "--impl", impl, str(recorded[0])) == (0, [f"identical: {n}/{n} steps"], [])


def rewrite(path: Path, out: Path, step: int, change: Any) -> None:
    lines = path.read_text().splitlines(keepends=True)
    for i, line in enumerate(lines):
        obj = json.loads(line)
        if obj.get("step") == step and "batch" in obj:
            change(obj)
            lines[i] = json.dumps(obj) + "\n"
    out.write_text("".join(lines))


def other_block(obj: dict[str, Any]) -> None:
    """A version-2 entry [id, tokens, kept, added]: another last block, or one block fewer kept."""
    entry = obj["batch"][-1]
    if entry[3]:
        entry[3][-1] = (entry[3][-1] + 1) % 12
    else:
        entry[2] -= 1


def fewer_tokens(obj: dict[str, Any]) -> None:
    obj["batch"][0][1] += 1


def flip_prefill(obj: dict[str, Any]) -> None:
    obj["prefill"] = not obj["prefill"]


def nobody_finished(obj: dict[str, Any]) -> None:
    obj["finished"] = []


def someone_preempted(obj: dict[str, Any]) -> None:
    obj["preempted"] = [obj["batch"][0][0]]


@pytest.mark.clause("TRACE-5", "TRACE-6")
@pytest.mark.parametrize(("change", "field"), [(other_block, "batch"), (fewer_tokens, "batch[0]"),
                                               (flip_prefill, "prefill"), (nobody_finished, "finished"),
                                               (someone_preempted, "preempted")])
def test_a_trace_changed_at_one_step_is_caught_at_that_step(
        recorded: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], change: Any,
        field: str) -> None:
    """TRACE-5, TRACE-6: the first differing step and field are named, exit 1, on both schedulers."""
    steps = load(recorded[0]).steps
    k = next(s.step for s in steps if s.finished and s.step > 2)
    bad = tmp_path / "bad.jsonl"
    rewrite(recorded[0], bad, k, change)
    for impl in ("reference", "optimized"):
        code, out, err = replay_cli(capsys, "--impl", impl, str(bad))
        assert code == 1 and err == [] and len(out) == 2
        assert out[0] == f"identical: {k}/{len(steps)} steps"
        assert out[1].startswith(f"first difference: step {k}: {field}"), out[1]


@pytest.mark.clause("TRACE-4")
def test_a_last_line_cut_short_is_reported_and_the_rest_replays(
        recorded: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """TRACE-4: a crash mid-write leaves a last line without its end: reported as such, everything before replays."""
    text = recorded[0].read_bytes()
    cut = tmp_path / "crashed.jsonl"
    cut.write_bytes(text[: len(text) - 25])
    lines = text.count(b"\n")
    trace = load(cut)
    assert trace.truncated is not None and f"line {lines} is cut short" in trace.truncated
    n = len(trace.steps)
    assert n == len(load(recorded[0]).steps) - 1
    code, out, err = replay_cli(capsys, str(cut))
    assert (code, out) == (0, [f"identical: {n}/{n} steps"])
    assert err == [f"nanoverify replay: warning: {trace.truncated}"]


def header_line(**changes: Any) -> str:
    config = {"block_size": 4, "num_blocks": 8, "max_num_seqs": 2, "max_num_batched_tokens": 8, "eos": 0}
    return json.dumps({"version": 1, "config": config, **changes})


ADD = json.dumps({"add": {"id": 0, "prompt": [1, 2, 3], "max_tokens": 1, "ignore_eos": False, "arrive": 0}})
STEP = {"step": 0, "prefill": True, "batch": [[0, 3, [0]]], "preempted": [], "tokens": [5], "finished": [0]}


def variant(**changes: Any) -> str:
    return json.dumps({k: v for k, v in {**STEP, **changes}.items() if v is not None})


@pytest.mark.clause("TRACE-4")
@pytest.mark.parametrize(("lines", "message"), [
    ([header_line(version=3), ADD, variant()], "line 1: version: must be 1 or 2, got 3"),
    ([header_line(), ADD, variant(tokens=None)], "line 3: step record: missing field 'tokens'"),
    ([header_line(), ADD, variant(tokens=[5, 6])], "line 3: tokens: has 2 tokens for a batch of 1"),
    ([header_line(), ADD, variant(batch=[[0, 3, [8]]])], "line 3: batch[0][2]: holds a block id past num_blocks=8"),
    ([header_line(), "{not json", variant()], "line 2: not JSON"),
    ([header_line(), ADD, ADD], "line 3: add.id: 0 was added before"),
    ([header_line(), ADD, variant(), json.dumps({"abort": 7, "before": 1})], "line 4: abort: request 7 was never"),
    ([header_line(), ADD, json.dumps({"cut": 7, "max_tokens": 1}), variant()], "line 3: cut: request 7 was never"),
    ([header_line(), ADD, variant(step=0), variant(step=0)], "line 4: step: is 0, expected at least 1"),
    ([header_line(), ADD], "the trace holds no step: nothing to replay"),
    ([ADD, variant()], "line 1: header: the first record must be the header"),
])
def test_a_bad_trace_is_refused_by_line_and_field(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  lines: list[str], message: str) -> None:
    """TRACE-4: a malformed record is one line naming the line and field, exit 2, nothing replayed."""
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match="^" + message.replace("[", r"\[").replace("]", r"\]").replace("{", r"\{")):
        load(path)
    code, out, err = replay_cli(capsys, str(path))
    assert (code, out) == (2, []) and len(err) == 1
    assert message in err[0] or (lines[0] == ADD and "nothing to replay" in err[0])  # headerless: not a trace


@pytest.mark.clause("TRACE-6")
def test_a_file_with_nothing_to_replay_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """TRACE-6: lines, none of them a workload or a trace header: exit 2, not a silent success."""
    path = tmp_path / "nothing.jsonl"
    path.write_text(json.dumps({"comment": "no workload here"}) + "\n[1, 2]\n")
    assert replay_cli(capsys, str(path)) == (2, [], ["nanoverify replay: no line holds a workload, and the first is "
                                                     "no trace header: nothing to replay"])


@pytest.mark.clause("TRACE-1", "TRACE-7")
def test_wall_times_are_recorded_on_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TRACE-7: with trace_wall_times each step holds its [start, end] seconds, increasing; the replay ignores them."""
    path = tmp_path / "timed.jsonl"
    eventful_run(path, monkeypatch, wall_times=True)
    trace = load(path)
    walls = [s.wall for s in trace.steps]
    assert all(w is not None for w in walls)
    ends = [w[1] for w in walls if w is not None]
    assert ends == sorted(ends) and all(w[0] <= w[1] for w in walls if w is not None)
    assert replay_trace(trace, "optimized").ok


@pytest.mark.clause("TRACE-1")
def test_trace_arguments_are_checked_before_loading() -> None:
    """TRACE-1: a bad trace argument is a ValueError naming it."""
    with pytest.raises(ValueError, match="trace must be a file path"):
        LLM(trace=3)
    with pytest.raises(ValueError, match="trace_wall_times must be a bool"):
        LLM(trace="x.jsonl", trace_wall_times=1)


class BreakARefCount:
    """An observer that corrupts the replayed scheduler right after its schedule() at one step."""

    def __init__(self, step: int) -> None:
        self.step, self.calls = step, 0

    def scheduled(self, scheduler: SchedulerPort[Any]) -> None:
        if self.calls == self.step:
            used = min(scheduler.snapshot().used_block_ids)
            if isinstance(scheduler, ReferencePort):  # a test may look inside: the replay does not
                scheduler.lesson_scheduler.block_manager.blocks[used].ref_count += 1
            else:  # the optimized pool keeps a used block's references past the first
                assert isinstance(scheduler, Scheduler)
                scheduler.block_manager.pool._extra[used] += 1
            assert scheduler.blocks.ref_count(used) == scheduler.snapshot().blocks[used].ref_count
        self.calls += 1

    def stepped(self, record: Step, scheduler: SchedulerPort[Any], batch: list[Any], id_of: dict[int, int]) -> None:
        pass


@pytest.mark.clause("TRACE-5")
@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_invariants_are_checked_at_every_step(impl: str) -> None:
    """TRACE-5: a state that breaks an invariant right after schedule() ends the replay at that step, naming the
    clause, although every recorded decision still matches."""
    trace = workload_trace(FIGURES["preemption"].workload())
    outcome = replay_trace(trace, impl, BreakARefCount(3))
    assert outcome.identical == 3 and outcome.difference is not None
    assert re.match(r"step 3: invariant INV-\d+ after schedule\(\): ", outcome.difference), outcome.difference


def preemption_lines() -> list[str]:
    return record_workload(FIGURES["preemption"].workload()).splitlines(keepends=True)


def after_first_finish(record: dict[str, Any]) -> list[str]:
    """The preemption figure's trace with ``record`` inserted after the first step that finished a request."""
    lines = preemption_lines()
    k = next(i for i, line in enumerate(lines) if json.loads(line).get("finished"))
    return [*lines[: k + 1], json.dumps(record) + "\n", *lines[k + 1 :]]


def twice_aborted() -> list[str]:
    lines = preemption_lines()
    k = next(i for i, line in enumerate(lines) if json.loads(line).get("step") == 0)
    abort = json.dumps({"abort": 3, "before": 1}) + "\n"
    return [*lines[: k + 1], abort, abort, *lines[k + 1 :]]


def walls(lines: list[str], spans: list[list[float]]) -> list[str]:
    """The first steps of ``lines`` given the wall times ``spans``."""
    out, it = [], iter(spans)
    for line in lines:
        record = json.loads(line)
        if "batch" in record and (span := next(it, None)) is not None:
            record["wall"] = span
        out.append(json.dumps(record) + "\n")
    return out


@pytest.mark.clause("TRACE-4")
@pytest.mark.parametrize(("lines", "message"), [
    (after_first_finish({"abort": 0, "before": 6}), "line 12: abort: request 0 was finished before"),
    (twice_aborted(), "line 8: abort: request 3 was aborted before"),
    (after_first_finish({"abort": 3, "before": 7}), "line 12: abort.before: is 7, but the next step is 6"),
    (after_first_finish({"cut": 1, "max_tokens": 2}), "line 12: cut: request 1 was finished before"),
    ([header_line(), json.dumps({"step": 0, "error": "empty decode"})],
     "line 2: step: step 0 comes before any request was added: there is nothing to schedule"),
    (walls(preemption_lines(), [[0.0, 1.0], [0.5, 2.0]]),
     "line 7: wall: starts at 0.5, before the previous step's end 1.0"),
])
def test_an_inconsistent_trace_is_refused_by_line(lines: list[str], message: str) -> None:
    """TRACE-4: an abort or a cut of a request that already ended (finished, aborted, failed), an abort whose
    `before` is not the next step, a step record before any request was added, and a step starting before the
    previous one ended are malformed files, refused by line and field (exit 2), not replay differences."""
    with pytest.raises(TraceError, match="^" + re.escape(message)):
        read_trace([line.encode() for line in lines])


@pytest.mark.clause("TRACE-4")
def test_a_hostile_max_tokens_reserves_nothing_and_nothing_follows_the_empty_decode(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """TRACE-4: max_tokens 2**62 replays (capped at one past the steps left: same decisions, bounded memory); a
    record after the empty decode is refused by line."""
    path = tmp_path / "huge.jsonl"
    path.write_text("\n".join([header_line(), ADD.replace('"max_tokens": 1', f'"max_tokens": {1 << 62}'),
                               variant(finished=[])]) + "\n")
    for impl in ("reference", "optimized"):
        assert replay_cli(capsys, "--impl", impl, str(path)) == (0, ["identical: 1/1 steps"], [])
    path.write_text("\n".join([header_line(), ADD, json.dumps({"step": 0, "error": "empty decode"}), variant()]))
    code, out, err = replay_cli(capsys, str(path))
    assert (code, out) == (2, []) and err == ["nanoverify replay: line 4: record: follows the empty decode, which "
                                              "ends a trace (CONF-4)"]


EDGE_VALUES: st.SearchStrategy[Any] = st.sampled_from([1 << 63, (1 << 63) - 1, -(1 << 63) - 1, -1, 0, 1, 2, 3, 11,
                                                       12, 1 << 62, None, True, "x", [], [0], {}, 1.5])
FIGURE_RECORDS = [[json.loads(line) for line in record_workload(f.workload()).splitlines()]
                  for f in FIGURES.values()]


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    return [prefix, *(p for key, child in children for p in _paths(child, (*prefix, key)))]


@st.composite
def mutated_trace(draw: st.DrawFn) -> bytes:
    """A figure's trace with a few values replaced, keys dropped or lines dropped, maybe a byte changed."""
    records = copy.deepcopy(draw(st.sampled_from(FIGURE_RECORDS)))
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["value", "value", "drop key", "drop line"]))
        if how == "drop line":
            del records[draw(st.integers(0, len(records) - 1))]
            continue
        path = draw(st.sampled_from([p for p in _paths(records) if len(p) > 1]))
        parent: Any = records
        for key in path[:-1]:
            parent = parent[key]
        if how == "drop key" and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(EDGE_VALUES)
    data = bytearray("".join(json.dumps(r) + "\n" for r in records).encode())
    if data and draw(st.integers(0, 3)) == 0:
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


@pytest.mark.clause("TRACE-4", "TRACE-5")
@settings(max_examples=60)
@given(mutated_trace())
def test_fuzz_a_mutated_trace_is_refused_or_replays_without_an_exception(data: bytes) -> None:
    """TRACE-4, TRACE-5: whatever is changed, the reader refuses it with a TraceError naming a line, or both
    schedulers replay it to an outcome (identical, or a named difference): no other exception."""
    try:
        trace = read_trace(data.splitlines(keepends=True))
    except TraceError as e:
        assert "\n" not in str(e) and str(e).startswith(("line ", "the trace")), str(e)
        return
    for impl in ("reference", "optimized"):
        outcome = replay_trace(trace, impl)
        assert outcome.difference is None or outcome.difference.startswith(("step ", "before step "))


@pytest.mark.clause("TRACE-6")
def test_a_trace_on_standard_input_replays(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """TRACE-6: `-` reads the trace from standard input, blank lines before the header included."""
    text = "\n\n" + record_workload(FIGURES["chunked-prefill"].workload())
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(text.encode()), encoding="utf-8"))
    n = len(workload_trace(FIGURES["chunked-prefill"].workload()).steps)
    assert replay_cli(capsys, "--impl", "optimized", "-") == (0, [f"identical: {n}/{n} steps"], [])
