"""POLICY-13, OPT-1: the optimized ``priority`` policy decides every step as reference/priority_scheduler.py.

The differential machine runs under the policy (each request draws a priority) and also compares what the
policy's own state says (``priorities``); a run is shown to reach overtaking and preemptions; a variant that
keeps the decode group whole when an admitted prefill lands among its members is caught by the machine. The
targeted tests pin the rules the reference states in its docstring: a prefill cut short keeps the front, a
preempted request goes to its place, an admitted one to its place in ``running``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, ClassVar

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from optimized.core.config import SchedulerConfig
from optimized.core.priority_scheduler import PriorityScheduler
from optimized.core.scheduler import Scheduler
from optimized.verify import conformance
from optimized.verify.machines import CI_SETTINGS
from optimized.verify.machines.differential_machine import DifferentialMachine, Disagreement
from optimized.verify.machines.policy_machines import PriorityDifferential
from optimized.verify.reference_port import ReferencePort
from reference.lpm_scheduler import LpmScheduler as ReferenceLpm


class PolicyMachine(DifferentialMachine):
    """The differential machine counting what a run reached, mixed in before a policy's machine.

    ``reach`` (a class attribute, one per subclass) counts, over every run: ``overtaken`` (a prefill step
    admitted a request while an earlier arrival kept waiting unallocated), ``preempted`` (requests preempted),
    ``due`` (lpm: waiting requests due at a prefill step, patience above 0).
    """

    reach: ClassVar[Counter[str]] = Counter()

    def schedule_both(self) -> tuple[list[Any], list[Any], bool] | None:
        preempted = self.stats.preemptions
        scheduled = super().schedule_both()
        reach = type(self).reach
        reach["preempted"] += self.stats.preemptions - preempted
        if scheduled is not None and scheduled[2]:
            assert isinstance(self.ref, ReferencePort)
            lesson, arrival, batch = self.ref.lesson_scheduler, self.ref_arrival, scheduled[0]
            latest = max(arrival[s.seq_id] for s in batch)
            reach["overtaken"] += sum(1 for s in lesson.waiting
                                      if arrival[s.seq_id] < latest and not s.block_table)
            if isinstance(lesson, ReferenceLpm) and lesson.patience:
                reach["due"] += sum(1 for s in lesson.waiting if lesson.passes[s.seq_id] >= lesson.patience)
        return scheduled


class CountedPriority(PolicyMachine, PriorityDifferential):
    reach: ClassVar[Counter[str]] = Counter()


@pytest.mark.clause("POLICY-13", "OPT-1")
class TestPriorityDifferential(PriorityDifferential.TestCase):  # type: ignore[misc,valid-type]  # hypothesis makes TestCase at run time
    """POLICY-13, OPT-1: the machine under the suite's profile (tests/conftest.py)."""

QUICK = settings(**{**CI_SETTINGS, "derandomize": True, "phases": [Phase.generate]})


def run_machine(machine: type[PolicyMachine], examples: int = QUICK.max_examples) -> Counter[str]:
    """What ``examples`` runs of ``machine`` reached; a negative control searches longer, up to its first failure
    (the machine's draws are seeded by its class, so how soon a mutant is met changes with it)."""
    machine.reach.clear()
    run_state_machine_as_test(machine, settings=settings(QUICK, max_examples=examples))
    return machine.reach


@pytest.mark.clause("POLICY-13")
def test_the_machine_reaches_overtaking_and_preemption() -> None:
    """POLICY-13: the runs the suite's profile draws make requests overtake earlier ones and preempt."""
    reach = run_machine(CountedPriority)
    assert reach["overtaken"] >= 10 and reach["preempted"] >= 5, reach


class KeepsTheGroup(PriorityScheduler):
    """Wrong: an admitted prefill goes to its place in running, but the decode group is kept whole."""

    def _place_admitted(self, count: int) -> None:
        members = self._group.members
        self._group.members = []  # the split below sees no member
        try:
            super()._place_admitted(count)
        finally:
            self._group.members = members


@pytest.mark.clause("POLICY-13", "OPT-2")
def test_the_machine_catches_a_group_kept_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """POLICY-13, OPT-2: negative control: with the group kept whole the machine reports a disagreement."""
    monkeypatch.setitem(conformance.IMPLEMENTATIONS, "optimized", KeepsTheGroup)
    with pytest.raises(Disagreement):
        run_machine(CountedPriority, examples=300)


# --- targeted: the rules of the reference's docstring, step by step beside it ------------------------------
class Twin:
    """The reference and the optimized scheduler of one config, fed the same requests and tokens."""

    def __init__(self, policy: str, **knobs: int) -> None:
        self.config = SchedulerConfig(**{"num_blocks": 16, "block_size": 2, "max_num_seqs": 8,
                                         "max_num_batched_tokens": 64, "eos": -1, **knobs}, policy=policy)
        self.ref = ReferencePort(self.config)
        opt = conformance.implementation("optimized")(self.config)
        assert isinstance(opt, Scheduler)
        self.opt = opt
        self.ids: dict[tuple[type, int], str] = {}  # (sequence class, seq_id) -> the request's name: each side counts

    def add(self, name: str, prompt: list[int], max_tokens: int = 8, priority: int = 0) -> None:
        r, o = self.ref.new_sequence(prompt, max_tokens, True), self.opt.new_sequence(prompt, max_tokens, True)
        self.ids[type(r), r.seq_id] = self.ids[type(o), o.seq_id] = name
        self.ref.add(r, (), priority)
        self.opt.add(o, (), priority)
        self.same()

    def names(self, seqs: Any) -> list[str]:
        return [self.ids[type(s), s.seq_id] for s in seqs]

    def step(self, token: int = 1) -> tuple[list[str], bool]:
        """One step on both; the batch's names and mode, equal on both (every grant and table too)."""
        r, o = self.ref.schedule(), self.opt.schedule()
        assert (self.names(r.batch), r.is_prefill) == (self.names(o.batch), o.is_prefill)
        assert [(s.num_scheduled_tokens, s.block_table) for s in r.batch] == \
            [(s.num_scheduled_tokens, s.block_table) for s in o.batch]
        assert self.names(r.preempted) == self.names(o.preempted)
        self.ref.postprocess(r.batch, [token] * len(r.batch), r.is_prefill)
        self.opt.postprocess(o.batch, [token] * len(o.batch), o.is_prefill)
        self.same()
        return self.names(r.batch), r.is_prefill

    def same(self) -> None:
        assert self.queues(self.ref) == self.queues(self.opt)
        members = self.opt._group.members
        assert self.opt.running[: len(members)] == members  # OPT-2: the group is a prefix of running

    def queues(self, port: Any) -> tuple[list[str], list[str]]:
        return self.names(port.waiting), self.names(port.running)


@pytest.mark.clause("POLICY-6", "POLICY-13")
def test_a_more_urgent_arrival_never_goes_before_a_prefill_cut_short() -> None:
    """POLICY-6: a prompt chunked at the budget keeps waiting[0] though a more urgent request arrives after the
    first chunk; behind it, waiting is in priority order; then it finishes first."""
    t = Twin("priority", max_num_batched_tokens=4)
    t.add("long", [5] * 10, priority=3)
    t.add("later", [6] * 2, priority=4)
    assert t.step() == (["long"], True)
    t.add("urgent", [7] * 2, priority=0)
    assert t.queues(t.opt) == (["long", "urgent", "later"], [])
    assert t.step() == (["long"], True)
    assert t.step() == (["long", "urgent"], True)  # its last 2 tokens, then the most urgent
    assert t.queues(t.opt) == (["later"], ["urgent", "long"])
    assert t.step() == (["later"], True)
    assert t.queues(t.opt) == ([], ["urgent", "long", "later"])


@pytest.mark.clause("POLICY-6", "POLICY-7", "POLICY-13")
def test_a_preempted_request_goes_to_its_place_and_the_least_urgent_is_preempted() -> None:
    """POLICY-6, POLICY-7: when a decode needs a block, the least urgent running request (not the newest) loses
    its blocks and waits behind a more urgent waiting one."""
    t = Twin("priority", num_blocks=5, max_num_batched_tokens=64)
    t.add("calm", [1, 2, 3], max_tokens=8, priority=5)  # two blocks, needs a third at length 5
    t.add("keen", [4, 5, 6], max_tokens=8, priority=1)
    assert t.step() == (["keen", "calm"], True)
    t.add("urgent", [9] * 9, priority=0)  # five blocks: cannot be admitted while the others hold four
    t.step()  # the decode to length 4
    names, is_prefill = t.step()  # length 5: both need a block, one is free
    assert not is_prefill and names == ["keen"]
    assert t.queues(t.opt) == (["urgent", "calm"], ["keen"])


@pytest.mark.clause("POLICY-5", "POLICY-13", "OPT-2")
def test_an_admitted_request_lands_in_its_place_and_the_group_splits_only_there() -> None:
    """POLICY-5, OPT-2: a prefill landing before decode-group members makes them leave (the group stays a prefix
    of running, the decodes stay the reference's); one landing behind them keeps every member."""
    t = Twin("priority")
    t.add("a", [1, 2, 3], priority=2)
    t.add("b", [2, 3, 4], priority=2)
    t.step()
    t.step()
    assert len(t.opt._group.members) == 2
    t.add("late", [3, 4, 5], priority=7)
    t.step()
    assert t.queues(t.opt)[1] == ["a", "b", "late"] and len(t.opt._group.members) == 2  # kept whole
    t.step()
    t.add("urgent", [4, 5, 6], priority=1)
    assert t.step() == (["urgent"], True)
    assert t.queues(t.opt)[1] == ["urgent", "a", "b", "late"] and t.opt._group.members == []
    assert t.step() == (["urgent", "a", "b", "late"], False)
    for _ in range(20):
        if t.ref.is_finished():
            break
        t.step()
    assert t.opt.is_finished() and t.ref.is_finished()


@pytest.mark.clause("POLICY-5")
@pytest.mark.parametrize("priority", [True, 1.0, "1", None])
def test_a_priority_that_is_not_an_int_is_refused_and_nothing_changes(priority: Any) -> None:
    """POLICY-5: ValueError naming priority (a bool too); nothing is queued and the sequence can be added later."""
    scheduler = PriorityScheduler(SchedulerConfig(num_blocks=4, block_size=2, policy="priority"))
    seq = scheduler.new_sequence([1, 2, 3], 2)
    with pytest.raises(ValueError, match="priority"):
        scheduler.add(seq, (), priority)
    assert not scheduler.waiting and scheduler.snapshot().priorities == {}
    scheduler.add(seq, (), -3)
    assert scheduler.snapshot().priorities == {seq.seq_id: -3}


@pytest.mark.clause("POLICY-13")
def test_the_snapshot_names_the_policy_and_each_live_priority() -> None:
    """POLICY-13: ``priorities`` maps each live sequence to its priority; a finished one leaves it."""
    scheduler = PriorityScheduler(SchedulerConfig(num_blocks=8, block_size=2, policy="priority"))
    short, long = scheduler.new_sequence([1, 2], 1), scheduler.new_sequence([3, 4], 5)
    scheduler.add(short, (), 4)
    scheduler.add(long, (), 2)
    assert scheduler.snapshot().policy == "priority"
    assert scheduler.snapshot().priorities == {short.seq_id: 4, long.seq_id: 2}
    out = scheduler.schedule()
    assert scheduler.postprocess(out.batch, [9, 9], True) == [short]
    assert scheduler.snapshot().priorities == {long.seq_id: 2}



@pytest.mark.clause("POLICY-6", "POLICY-13")
def test_a_finished_cut_short_prefill_and_an_urgent_admission_both_land_in_their_places() -> None:
    """POLICY-6: a step that finishes a prefill cut short (less urgent than a running request) and admits a more
    urgent arrival behind it leaves running in (priority, arrival) order on both sides. Negative control of the
    reference's old one-at-a-time placement, which bisected a running queue whose tail was still unplaced and
    left ["urgent", "calm", "long"]."""
    t = Twin("priority", max_num_batched_tokens=8)
    t.add("calm", [1, 2, 3], priority=10)
    assert t.step() == (["calm"], True)
    t.add("long", list(range(100, 112)), priority=9)
    assert t.step() == (["long"], True)  # 8 of its 12 tokens: it keeps the front
    t.add("urgent", [5, 6], priority=2)
    assert t.step() == (["long", "urgent"], True)
    assert t.queues(t.ref) == ([], ["urgent", "long", "calm"])
