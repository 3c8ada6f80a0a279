"""POLICY-14: the policies' shipped conformance samples, replayed by both implementations of each policy.

data/policies.jsonl is the generator's output (optimized/verify/policy_samples.py: fixed seeds, each trace
recorded on the policy's reference); every sample replays to its trace on the reference and on the optimized
class of its policy, the state invariants and the batch clauses the policy keeps checked at every step. The
samples reach what each policy changes (chunks, preemptions, overtaking, due requests); the lesson's
scheduler, a wrong reference and a wrong optimized variant of each policy are told apart by them. The
workload format's additions (``config.policy``, ``config.patience``, a request's ``priority``) are refused
by field when bad, and the lesson's samples mean what they meant.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections import Counter
from functools import partial
from typing import Any

import pytest

import reference
from invariants import Violation, check_state, seq_view
from optimized.cli.conformance import (
    policy_of,
    policy_snapshot,
    shipped_policy_samples,
    shipped_samples,
    step_violations,
)
from optimized.core.config import SchedulerConfig
from optimized.core.errors import WorkloadError
from optimized.core.port import PortFactory, ScheduleOutput, SchedulerPort
from optimized.verify import policy_samples
from optimized.verify.conformance import ReplayWatcher, implementation, parse_workload, replay
from optimized.verify.reference_port import ReferencePort
from reference.lpm_scheduler import LpmScheduler
from reference.priority_scheduler import PriorityScheduler
from tests.test_core_lpm import NoDueRule
from tests.test_core_priority import KeepsTheGroup

SAMPLES = shipped_policy_samples()
POLICIES = ("mixed", "priority", "lpm")


@pytest.mark.clause("POLICY-14")
def test_the_shipped_samples_are_the_generators_output() -> None:
    """POLICY-14: 15 samples a policy, exactly what the generator draws and the policies' references trace."""
    assert json.loads(json.dumps(policy_samples.samples())) == SAMPLES
    assert Counter(map(policy_of, SAMPLES)) == dict.fromkeys(POLICIES, 15)


def replay_checked(sample: dict[str, Any], factory: PortFactory) -> tuple[list[dict[str, Any]], list[Violation]]:
    violations: list[Violation] = []

    def after_schedule(port: SchedulerPort[Any], batch: list[Any], is_prefill: bool) -> None:
        violations.extend(step_violations(policy_snapshot(port), [seq_view(s) for s in batch], is_prefill))
        violations.extend(check_state(policy_snapshot(port), between_steps=False))

    def after_postprocess(port: SchedulerPort[Any], batch: list[Any], is_prefill: bool) -> None:
        violations.extend(check_state(policy_snapshot(port)))

    return replay(parse_workload(sample["workload"]), factory, after_schedule, after_postprocess), violations


@pytest.mark.clause("POLICY-14", "POLICY-13")
@pytest.mark.parametrize("impl", ["reference", "optimized"])
@pytest.mark.parametrize("index", range(len(SAMPLES)))
def test_each_sample_replays_to_its_trace(index: int, impl: str) -> None:
    """POLICY-14: the recorded trace, to the last block id, on both implementations; no violation on the way."""
    sample = SAMPLES[index]
    trace, violations = replay_checked(sample, implementation(impl))
    assert trace == sample["trace"]
    assert violations == []


class Reach(ReplayWatcher):
    """What a replay on the reference did that the policy decides, counted as each step is scheduled."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def scheduled(self, port: SchedulerPort[Any], out: ScheduleOutput[Any]) -> None:
        assert isinstance(port, ReferencePort)
        lesson, counts, batch = port.lesson_scheduler, self.counts, out.batch
        counts["chunks"] += sum(1 for s in batch if s.is_prefill and s.num_cached_tokens + s.num_scheduled_tokens
                                < s.num_tokens)
        counts["preempted"] += len(out.preempted)
        counts["mixed steps"] += any(not s.is_prefill for s in batch) and any(s.is_prefill for s in batch)
        if out.is_prefill:
            latest = max(s.seq_id for s in batch)
            counts["overtaken"] += sum(1 for s in lesson.waiting if s.seq_id < latest and not s.block_table)
        if isinstance(lesson, LpmScheduler) and lesson.patience:
            counts["due"] += sum(1 for s in lesson.waiting if lesson.passes[s.seq_id] >= lesson.patience)


@pytest.mark.clause("POLICY-14")
@pytest.mark.parametrize("policy", POLICIES)
def test_the_samples_reach_what_the_policy_changes(policy: str) -> None:
    """POLICY-14: each policy's samples chunk prompts and preempt; mixed's decode beside prefills; priority's and
    lpm's admit later arrivals before earlier ones; lpm's make requests due; priority's hold several priorities,
    lpm's several patiences (and the default)."""
    reach = Reach()
    mine = [s for s in SAMPLES if policy_of(s) == policy]
    for sample in mine:
        replay(parse_workload(sample["workload"]), implementation("reference"), watcher=reach)
    counts = reach.counts
    assert counts["chunks"] >= 10 and counts["preempted"] >= 5, counts
    if policy == "mixed":
        assert counts["mixed steps"] >= 10 and counts["overtaken"] == 0, counts  # mixed admits in arrival order
    else:
        assert counts["overtaken"] >= 10, counts
    if policy == "lpm":
        assert counts["due"] >= 5, counts
        assert len({s["workload"]["config"].get("patience") for s in mine}) >= 4
    if policy == "priority":
        assert len({r["priority"] for s in mine for r in s["workload"]["requests"]}) >= 4


def differing(policy: str, factory: PortFactory) -> tuple[int, int]:
    """How many of ``policy``'s samples ``factory``'s scheduler replays to another trace, and how many it raises
    on (a variant that breaks its own bookkeeping: the replay, and so the command, fails)."""
    other = raised = 0
    for sample in (s for s in SAMPLES if policy_of(s) == policy):
        try:
            other += replay(parse_workload(sample["workload"]), factory) != sample["trace"]
        except (AssertionError, IndexError, ValueError):
            raised += 1
    return other, raised


def as_lesson(sample: dict[str, Any]) -> dict[str, Any]:
    """The same workload for the lesson's policy (priorities dropped)."""
    workload = copy.deepcopy(sample["workload"])
    workload["config"]["policy"] = "lesson"
    for r in workload["requests"]:
        r.pop("priority", None)
    return {"workload": workload, "trace": sample["trace"]}


@pytest.mark.clause("POLICY-14")
@pytest.mark.parametrize("policy", POLICIES)
def test_the_traces_tell_the_policy_from_the_lessons(policy: str) -> None:
    """POLICY-14: negative control: the lesson's scheduler replays most of each policy's samples otherwise."""
    lesson = implementation("reference")
    mine = [as_lesson(s) for s in SAMPLES if policy_of(s) == policy]
    assert sum(replay(parse_workload(s["workload"]), lesson) != s["trace"] for s in mine) >= 10


class PreemptedToTheFront(PriorityScheduler):
    """A wrong priority reference: a preempted request goes back to the front of waiting, as in the lesson."""

    def preempt(self, seq: reference.Sequence) -> None:
        reference.Scheduler.preempt(self, seq)


def unbounded_lpm(config: SchedulerConfig) -> ReferencePort:
    """A wrong lpm reference: its patience is never reached (nobody is ever due)."""

    class Unbounded(LpmScheduler):
        def __init__(self, lesson_config: reference.SchedulerConfig) -> None:
            super().__init__(lesson_config, patience=1 << 62)

    return ReferencePort(config, lesson=Unbounded)


@pytest.mark.clause("POLICY-14")
def test_the_traces_tell_wrong_variants_of_each_policy() -> None:
    """POLICY-14: negative controls: a reference that preempts to the front, one without the starvation bound and
    an optimized lpm without the due rule each replay some sample of their policy to another trace, none raising;
    an optimized priority class that keeps its decode group whole breaks its own group on some sample (the
    replay raises: the group is no longer a prefix of running)."""
    for policy, variant in (("priority", partial(ReferencePort, lesson=PreemptedToTheFront)),
                            ("lpm", unbounded_lpm), ("lpm", NoDueRule)):
        other, raised = differing(policy, variant)
        assert other > 0 and raised == 0, (variant, other, raised)
    assert differing("priority", KeepsTheGroup)[1] > 0


# --- the workload format's additions ------------------------------------------------------------------------------
def with_change(change: dict[str, Any], request: dict[str, Any] | None = None) -> dict[str, Any]:
    """A priority sample's workload with ``change`` to its config (priorities 0 under another policy) and
    ``request`` to its first request."""
    workload: dict[str, Any] = copy.deepcopy(next(s for s in SAMPLES if policy_of(s) == "priority")["workload"])
    if change.get("policy", "priority") != "priority":
        for r in workload["requests"]:
            r["priority"] = 0
    workload["config"].update(change)
    workload["requests"][0].update(request or {})
    return workload


@pytest.mark.clause("POLICY-14", "CONF-1")
@pytest.mark.parametrize(("change", "request_change", "field"), [
    ({"policy": "fifo"}, None, "config.policy"),
    ({"policy": 3}, None, "config.policy"),
    ({"policy": None}, None, "config.policy"),
    ({"patience": -1}, None, "config.patience"),
    ({"patience": True}, None, "config.patience"),
    ({"patience": 1.5}, None, "config.patience"),
    ({}, {"priority": True}, "requests[0].priority"),
    ({}, {"priority": "1"}, "requests[0].priority"),
    ({}, {"priority": 1 << 63}, "requests[0].priority"),
    ({"policy": "lpm"}, {"priority": 1}, "requests[0].priority"),
])
def test_a_bad_policy_field_is_refused_by_name(change: dict[str, Any], request_change: dict[str, Any] | None,
                                               field: str) -> None:
    """POLICY-14, CONF-1: WorkloadError naming the field; a priority other than 0 only under ``priority``."""
    workload = with_change(change, request_change)
    with pytest.raises(WorkloadError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_workload(workload)


@pytest.mark.clause("POLICY-14", "CONF-1")
def test_the_additions_parse_and_the_lessons_samples_mean_the_same() -> None:
    """POLICY-14, CONF-1: policy, patience and priorities come through; a lesson sample's config holds no policy
    field, and naming the lesson's policy with priorities 0 changes no trace."""
    parsed = parse_workload(with_change({"policy": "priority"}, {"priority": -7}))
    assert parsed.config["policy"] == "priority" and parsed.requests[0].priority == -7
    lpm = parse_workload(with_change({"policy": "lpm", "patience": 0}, {"priority": 0}))
    assert (lpm.config["policy"], lpm.config["patience"]) == ("lpm", 0)
    lesson = shipped_samples()[5]
    assert set(parse_workload(lesson["workload"]).config) == {"block_size", "num_blocks", "max_num_seqs",
                                                              "max_num_batched_tokens", "eos"}
    named = copy.deepcopy(lesson["workload"])
    named["config"]["policy"] = "lesson"
    for r in named["requests"]:
        r["priority"] = 0
    assert replay(parse_workload(named), implementation("optimized")) == lesson["trace"]


@pytest.mark.clause("POLICY-6", "POLICY-14")
def test_the_priority_batch_check_sees_a_queue_out_of_order() -> None:
    """POLICY-6: negative controls of the replay's priority check: right after an urgent prefill lands before a
    running request, the state passes; the same state named the lesson's fails INV-20 (the exemption is
    priority's alone); running swapped, or (between steps) a waiting request out of place, fails POLICY-6."""
    scheduler = implementation("optimized")(SchedulerConfig(num_blocks=16, block_size=2, policy="priority"))
    calm, urgent, late = (scheduler.new_sequence([1, 2, 3], 4), scheduler.new_sequence([4, 5, 6], 4),
                          scheduler.new_sequence([7, 8, 9, 1], 4))
    scheduler.add(calm, (), 5)
    out = scheduler.schedule()
    scheduler.postprocess(out.batch, [1], True)
    scheduler.add(urgent, (), 0)
    out = scheduler.schedule()
    state, batch = scheduler.snapshot(), [seq_view(s) for s in out.batch]
    assert [s.seq_id for s in state.running] == [urgent.seq_id, calm.seq_id]
    assert step_violations(state, batch, True) == []
    lesson = [v.clause for v in step_violations(dataclasses.replace(state, policy="lesson"), batch, True)]
    assert "INV-20" in lesson
    swapped = dataclasses.replace(state, running=state.running[::-1])
    assert "POLICY-6" in [v.clause for v in step_violations(swapped, batch, True)]
    scheduler.postprocess(out.batch, [1], True)
    scheduler.add(late, (), 9)
    state = scheduler.snapshot()
    waiting = [dataclasses.replace(state.waiting[0], seq_id=s) for s in (late.seq_id, late.seq_id + 1)]
    order = dataclasses.replace(state, waiting=waiting, priorities={**state.priorities, late.seq_id + 1: 1})
    assert "POLICY-6" in [v.clause for v in check_state(order)]
    assert check_state(state) == []
