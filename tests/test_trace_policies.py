"""Traces know the policy (POLICY-16): a run recorded under each policy names it (and lpm's patience) in its header
and each request's priority in its add record, and replays identically through that policy's implementations; the
same records judged under another policy, or without their priorities, diverge; hostile values are refused by
field; a trace without them is the lesson's."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from optimized import SamplingParams
from optimized.cli.replay import replay_recorded
from optimized.core.config import POLICIES, SchedulerConfig
from optimized.core.policies import make_scheduler
from optimized.trace.recorder import Recorder, TraceObserver
from optimized.trace.replay import replay_trace
from optimized.trace.schema import TraceError, read_trace
from optimized.trace.timeline import config_line
from optimized.trace.workload import workload_trace
from optimized.verify.conformance import parse_workload
from optimized.verify.reference_port import ReferencePort
from tests.engine_fixtures import make_llm

SHARED = list(range(1, 9))
# per step: (prompt, max_tokens, priority): shared prefixes for lpm, a long prompt to chunk, urgent late arrivals
ARRIVALS: dict[int, list[tuple[list[int], int, int]]] = {
    0: [([*SHARED, 20], 4, 2), (list(range(30, 52)), 3, 3)],
    1: [([60, 61, 62, 63, 64], 3, 1), ([*SHARED, 21], 3, 0)],
    2: [([70, 71], 5, 0), ([*SHARED, 22, 23], 2, 3)],
    4: [([80, 81, 82], 4, 1), ([*SHARED, 24], 3, 2)],
}


def record(policy: str) -> str:
    """A run of the policy's reference through the recorder, as the engine records one (adds, decisions, tokens)."""
    cfg = SchedulerConfig(num_blocks=14, block_size=4, max_num_seqs=3, max_num_batched_tokens=10, eos=-1,
                          policy=policy, patience=2)
    out = io.StringIO()
    recorder = Recorder(out, cfg)
    port = ReferencePort(cfg)
    ids: dict[int, int] = {}
    rid = 0
    for step in range(200):
        for prompt, max_tokens, priority in ARRIVALS.get(step, []):
            priority = priority if policy == "priority" else 0
            seq = port.new_sequence(prompt, max_tokens)
            port.add(seq, priority=priority)
            ids[seq.seq_id] = rid
            recorder.add(rid, prompt, max_tokens, False, priority)
            rid += 1
        if port.is_finished():
            if step > max(ARRIVALS):
                break
            recorder.at_step(step + 1)
            continue
        sched = port.schedule()
        decided = recorder.decided(sched.is_prefill, [(ids[s.seq_id], s.num_scheduled_tokens, s.block_table)
                                                      for s in sched.batch], [ids[s.seq_id] for s in sched.preempted])
        tokens = [(step * 3 + s.num_tokens) % 50 + 100 for s in sched.batch]
        finished = port.postprocess(sched.batch, tokens, sched.is_prefill)
        recorder.step(decided, tokens, [ids[s.seq_id] for s in finished])
    assert port.is_finished()
    return out.getvalue()


def lines(text: str) -> list[bytes]:
    return text.encode().splitlines(keepends=True)


def edited(text: str, header: dict[str, Any] | None = None, strip_priorities: bool = False) -> str:
    """``text`` with its header's config updated by ``header`` (None values removed), and maybe its priorities."""
    records = [json.loads(line) for line in text.splitlines()]
    for key, value in (header or {}).items():
        if value is None:
            records[0]["config"].pop(key, None)
        else:
            records[0]["config"][key] = value
    if strip_priorities:
        for r in records:
            if "add" in r:
                r["add"].pop("priority", None)
    return "".join(json.dumps(r) + "\n" for r in records)


IMPLS = ("reference", "optimized")


@pytest.mark.clause("POLICY-16", "TRACE-14", "TRACE-1", "TRACE-6")
@pytest.mark.parametrize("policy", POLICIES)
def test_a_run_under_each_policy_replays_identically_naming_its_policy(policy: str, capsys: Any) -> None:
    """POLICY-16: the header names a non-lesson run's policy and patience, each add record a priority that is not
    0; the trace replays identically through the policy's implementations, and replay says the policy."""
    text = record(policy)
    header = json.loads(text.splitlines()[0])["config"]
    trace = read_trace(lines(text))
    assert (trace.policy, trace.config["patience"]) == (policy, 2 if policy != "lesson" else 8)
    assert ("policy" in header) == (policy != "lesson")
    assert bool(trace.priorities) == (policy == "priority")
    for impl in IMPLS:
        outcome = replay_trace(trace, impl)
        assert outcome.ok and outcome.identical == outcome.steps > 10, outcome
        assert replay_recorded(trace, impl) == 0
        out = capsys.readouterr().out.strip().splitlines()
        note = {"lesson": "", "lpm": " (policy lpm, patience 2)"}.get(policy, f" (policy {policy})")
        assert out == [f"identical: {outcome.steps}/{outcome.steps} steps{note}"]
    assert config_line(trace.config).endswith({"lesson": "policy lesson", "lpm": "policy lpm (patience 2)"}
                                              .get(policy, f"policy {policy}"))


@pytest.mark.clause("POLICY-16", "TRACE-14", "TRACE-6")
@pytest.mark.parametrize(("policy", "header", "strip"), [
    ("mixed", {"policy": None, "patience": None}, False),  # read as the lesson's
    ("lpm", {"policy": "lesson"}, False),
    ("lpm", {"patience": 0}, False),
    ("lesson", {"policy": "mixed"}, False),
    ("priority", {}, True),  # the priorities lost
    ("priority", {"policy": "lpm"}, True),
])
def test_a_trace_judged_under_another_policy_diverges(policy: str, header: dict[str, Any], strip: bool,
                                                       capsys: Any) -> None:
    """POLICY-16's negative control: the same records with the header naming another policy (or patience), or
    without their priorities, replay to a difference, which replay reports with exit 1."""
    trace = read_trace(lines(edited(record(policy), header, strip)))
    for impl in IMPLS:
        outcome = replay_trace(trace, impl)
        assert not outcome.ok and outcome.difference is not None and outcome.difference.startswith("step ")
        assert replay_recorded(trace, impl) == 1
        assert "first difference: step " in capsys.readouterr().out


@pytest.mark.clause("POLICY-16", "TRACE-14", "TRACE-4")
@pytest.mark.parametrize(("where", "value", "field"), [
    ("config", {"policy": "fifo"}, "config.policy"),
    ("config", {"policy": 3}, "config.policy"),
    ("config", {"policy": ["lesson"]}, "config.policy"),
    ("config", {"patience": -1}, "config.patience"),
    ("config", {"patience": True}, "config.patience"),
    ("config", {"patience": "8"}, "config.patience"),
    ("config", {"patience": 1 << 63}, "config.patience"),
    ("add", {"priority": True}, "add.priority"),
    ("add", {"priority": 1.5}, "add.priority"),
    ("add", {"priority": "1"}, "add.priority"),
    ("add", {"priority": 1 << 63}, "add.priority"),
    ("add", {"priority": 1}, "add.priority"),  # under the lesson's policy
])
def test_hostile_policy_fields_are_refused_naming_the_field(where: str, value: dict[str, Any], field: str) -> None:
    """POLICY-16: a policy that is not one of the four, a patience that is not an int in [0, 2**63), a priority
    that is not an int64, or not 0 unless the policy is priority: a TraceError naming the field and line."""
    records = [json.loads(line) for line in record("lesson").splitlines()]
    target = records[0]["config"] if where == "config" else next(r["add"] for r in records if "add" in r)
    target.update(value)
    with pytest.raises(TraceError, match=rf"line \d+: {field}"):
        read_trace(lines("".join(json.dumps(r) + "\n" for r in records)))


@pytest.mark.clause("POLICY-16", "TRACE-14", "TRACE-1")
def test_an_old_trace_is_the_lessons_and_a_priority_is_an_int64() -> None:
    """A header without policy or patience reads as the lesson's, patience 8 (every trace before them replays); a
    priority at either end of int64 reads under the priority policy."""
    trace = read_trace(lines(edited(record("lesson"), {"policy": None, "patience": None})))
    assert (trace.policy, trace.config["patience"], trace.priorities) == ("lesson", 8, {})
    assert replay_trace(trace, "reference").ok
    records = [json.loads(line) for line in record("priority").splitlines()]
    adds = [r["add"] for r in records if "add" in r]
    adds[0]["priority"], adds[1]["priority"] = -(1 << 63), (1 << 63) - 1
    trace = read_trace(lines("".join(json.dumps(r) + "\n" for r in records)))
    assert (trace.priority(adds[0]["id"]), trace.priority(adds[1]["id"])) == (-(1 << 63), (1 << 63) - 1)


@pytest.mark.clause("POLICY-16", "TRACE-14", "TRACE-2")
def test_the_engines_observer_records_each_requests_priority() -> None:
    """The engine's trace observer writes the request's ``priority`` into its add record (none when it is 0)."""
    out = io.StringIO()
    recorder = Recorder(out, SchedulerConfig(num_blocks=8, block_size=4, policy="priority"))
    observer = TraceObserver(recorder, -1)
    params = SimpleNamespace(max_tokens=3, ignore_eos=False)
    for arrival, priority in ((0, -2), (1, 0)):
        observer.added(SimpleNamespace(arrival=arrival, seq=SimpleNamespace(token_ids=[1, 2], num_prompt_tokens=2),
                                       params=params, priority=priority))
    recorder.file.flush()
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert records[0]["config"]["policy"] == "priority"
    assert [r["add"].get("priority") for r in records[1:]] == [-2, None]


POLICY_SAMPLES = Path(__file__).resolve().parent.parent / "optimized" / "verify" / "data" / "policies.jsonl"


@pytest.mark.clause("POLICY-16", "TRACE-14", "TRACE-8")
def test_the_policy_samples_recorded_as_traces_replay_identically() -> None:
    """TRACE-8 under every policy: each shipped policy workload recorded through its reference names its policy
    (and its priorities) and replays identically through both implementations."""
    samples = [json.loads(line) for line in POLICY_SAMPLES.read_text(encoding="utf-8").splitlines() if line.strip()]
    seen: set[str] = set()
    for sample in samples:
        workload = parse_workload(sample["workload"])
        trace = workload_trace(workload)
        assert trace.policy == workload.config["policy"]
        assert trace.priorities == {r.id: r.priority for r in workload.requests if r.priority}
        for impl in IMPLS:
            outcome = replay_trace(trace, impl)
            assert outcome.ok and outcome.identical == outcome.steps, (trace.policy, impl, outcome)
        seen.add(trace.policy)
    assert seen == {"mixed", "priority", "lpm"}
    assert any(trace.priorities for trace in [workload_trace(parse_workload(s["workload"])) for s in samples[15:30]])


@pytest.mark.clause("POLICY-16", "TRACE-14", "CHECK-7")
@pytest.mark.usefixtures("engine_env")
@pytest.mark.parametrize("policy", POLICIES)
def test_an_engine_run_checked_and_recorded_under_each_policy(policy: str, tmp_path: Path, capsys: Any) -> None:
    """POLICY-16 on the engine: ``LLM(scheduling_policy=..., check=True, trace=...)`` runs its shadow of the same
    policy without a divergence (whole states compared), records the policy and each priority, and the trace
    replays identically through both implementations."""
    path = tmp_path / f"{policy}.jsonl"
    llm = make_llm(kvcache_block_size=2, num_kvcache_blocks=40, max_num_batched_tokens=12, max_num_seqs=3,
                   scheduling_policy=policy, lpm_patience=1, check=True, check_full_every=2, trace=str(path))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, i] for i in range(3)] + [[40 + i, 41, 42] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    priority = [3, 1, 2, 0, 2, 1] if policy == "priority" else None
    llm.generate(prompts, params, False, priority=priority)
    assert llm.shadow is not None and llm.shadow.full_comparisons > 0
    llm.close()
    trace = read_trace(path.read_bytes().splitlines(keepends=True))
    assert trace.policy == policy and len(trace.priorities) == (5 if policy == "priority" else 0)
    for impl in ("reference", "optimized"):
        assert replay_recorded(trace, impl) == 0
        assert capsys.readouterr().out.startswith(f"identical: {len(trace.steps)}/{len(trace.steps)} steps")


@pytest.mark.clause("POLICY-16", "POLICY-15", "TRACE-14")
@pytest.mark.parametrize("full", [False, True])
def test_the_replays_checks_judge_the_priorities_the_trace_recorded(full: bool) -> None:
    """POLICY-15, POLICY-16: the replay's checks judge POLICY-6 with the priorities the trace recorded (what
    ``batch_violations`` and ``state_violations`` are handed), never with those the implementation under test
    reports of itself; so queues in the order of other priorities than the recorded ones are reported, on the
    light checks and the full ones alike. The control: the recorded priorities themselves find nothing."""
    from optimized.trace.checks import batch_violations, state_violations

    port = make_scheduler(SchedulerConfig(num_blocks=32, block_size=4, max_num_seqs=1, policy="priority"))
    seqs = [port.new_sequence([1 + i, 2, 3], 4) for i in range(3)]
    for seq, priority in zip(seqs, (2, 0, 1), strict=True):
        port.add(seq, priority=priority)
    out = port.schedule()
    recorded = {s.seq_id: p for s, p in zip(seqs, (2, 0, 1), strict=True)}
    reversed_ = {s.seq_id: p for s, p in zip(seqs, (0, 2, 1), strict=True)}  # another order of the same queues
    assert batch_violations(port, out.batch, out.is_prefill, full, recorded) == []
    assert [v.clause for v in batch_violations(port, out.batch, out.is_prefill, full, reversed_)] == ["POLICY-6"]
    port.postprocess(out.batch, [7] * len(out.batch), out.is_prefill)
    assert state_violations(port, full, recorded) == []
    assert [v.clause for v in state_violations(port, full, reversed_)] == ["POLICY-6"]


@pytest.mark.clause("POLICY-12", "POLICY-16", "TRACE-4")
@pytest.mark.usefixtures("engine_env")
def test_a_priority_is_counted_when_the_trace_checks_an_add_records_length(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """TRACE-4 with POLICY-12: the door's check of an add record's length counts the widest priority as it counts
    the widest id and step, so a request whose record with its priority would pass the reader's line limit is
    refused before anything changes (a ValueError, the engine trusted, nothing added), never after it was added
    (which left the engine half changed and untrusted); a shorter prompt is then taken."""
    import optimized.trace.recorder as recorder_module

    llm = make_llm(num_kvcache_blocks=64, scheduling_policy="priority", trace=str(tmp_path / "t.jsonl"))
    assert llm.recorder is not None
    prompt = list(range(1, 30))
    widest_without_priority = recorder_module.add_record(recorder_module.INT64_MAX, prompt, 2, False,
                                                         recorder_module.INT64_MAX)
    monkeypatch.setattr(recorder_module, "MAX_LINE_BYTES", len(widest_without_priority))
    llm.recorder.at_step(10**6)  # a long run: its add records carry a seven-digit step
    with pytest.raises(ValueError, match="line limit"):
        llm.add_request(prompt, SamplingParams(max_tokens=2), priority=-(1 << 63))
    assert llm.engine.trusted and llm.engine.live == {} and llm.engine.scheduler.is_finished()
    llm.add_request(prompt[:20], SamplingParams(max_tokens=2), priority=-(1 << 63))
    assert len(llm.engine.live) == 1
    llm.close()
