"""The invariants per policy (POLICY-15): each policy's own state clause reported on a corrupted snapshot of a real
run of its reference and on a real run of a variant that breaks it, nothing on the sound run; FIFO (INV-6) the
lesson's alone; the batch clauses as each policy places its batch."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from invariants import SchedulerState, Violation, check_batch, check_state, seq_view, snapshot
from optimized.core.config import SchedulerConfig
from optimized.verify.reference_port import ReferencePort
from reference.lpm_scheduler import LpmScheduler
from reference.mixed_scheduler import MixedScheduler
from reference.priority_scheduler import PriorityScheduler
from reference.sequence import Sequence

Arrivals = list[list[tuple[list[int], int, int]]]  # per step: (prompt, max_tokens, priority)


def clauses(found: list[Violation]) -> set[str]:
    return {v.clause for v in found}


def run(port: ReferencePort, arrivals: Arrivals, steps: int = 200) -> tuple[list[SchedulerState], list[Violation]]:
    """Drive ``port`` (arrivals before each step, then until done); every state right after schedule() and after
    postprocess, and every violation of ``check_state`` and ``check_batch`` met on the way."""
    states: list[SchedulerState] = []
    found: list[Violation] = []
    pending = list(arrivals)
    for _ in range(steps):
        for prompt, max_tokens, priority in pending.pop(0) if pending else []:
            port.add(port.new_sequence(prompt, max_tokens), priority=priority)
        if port.is_finished():
            if pending:
                continue
            break
        out = port.schedule()
        state = port.snapshot()
        found += check_state(state, between_steps=False) + check_batch(state, [seq_view(s) for s in out.batch],
                                                                       out.is_prefill)
        port.postprocess(out.batch, [5] * len(out.batch), out.is_prefill)
        states += [state, port.snapshot()]
        found += check_state(states[-1])
    return states, found


def config(policy: str, **knobs: Any) -> SchedulerConfig:
    values = {"num_blocks": 24, "block_size": 4, "max_num_seqs": 2, "max_num_batched_tokens": 16, "eos": -1,
              "policy": policy, **knobs}
    return SchedulerConfig(**values)


# --- priority: POLICY-6 -------------------------------------------------------------------------------------------
URGENCY: Arrivals = [[([1, 2, 3], 4, 3), ([4, 5, 6], 4, 1), ([7, 8, 9], 4, 2), ([10, 11], 4, 0)],
                     [(list(range(20, 45)), 3, 5)], [([50, 51], 3, 0)]]


def _priority_state() -> SchedulerState:
    """Between steps with two running and two waiting, in (priority, arrival) order (not arrival order)."""
    port = ReferencePort(config("priority"))
    for prompt, max_tokens, priority in URGENCY[0]:
        port.add(port.new_sequence(prompt, max_tokens), priority=priority)
    out = port.schedule()
    port.postprocess(out.batch, [5] * len(out.batch), out.is_prefill)
    state = port.snapshot()
    assert len(state.running) == len(state.waiting) == 2
    return state


@pytest.mark.clause("POLICY-15", "POLICY-6")
def test_priority_order_holds_on_a_real_run_and_fifo_is_not_asked() -> None:
    """POLICY-15: a priority run keeps every state and batch clause, POLICY-6 included, at every step; its queues
    are not in arrival order, so INV-6 (the lesson's) would report them: the gate is what lets it pass."""
    states, found = run(ReferencePort(config("priority", max_num_batched_tokens=8)), URGENCY)
    assert found == []
    assert any(s.waiting and s.waiting[0].block_table for s in states)  # a prefill cut short at the front
    state = _priority_state()
    assert state.priorities == {s.seq_id: p for s, p in zip([*state.running, *state.waiting], (0, 1, 2, 3),
                                                             strict=True)}
    assert "INV-6" in clauses(check_state(dataclasses.replace(state, policy="lesson")))


@pytest.mark.clause("POLICY-15", "POLICY-6")
def test_priority_order_corrupted_is_reported() -> None:
    """POLICY-6: running or waiting out of (priority, seq_id) order, or a live sequence without a priority, is
    reported; under the lesson's policy the same priorities are not read."""
    state = _priority_state()
    assert check_state(state) == []
    swapped = dataclasses.replace(state, running=state.running[::-1])
    assert clauses(check_state(swapped)) == {"POLICY-6"}
    first = state.waiting[0].seq_id
    demoted = dataclasses.replace(state, priorities={**state.priorities, first: 9})
    assert clauses(check_state(demoted)) == {"POLICY-6"}
    missing = dataclasses.replace(state, priorities={k: v for k, v in state.priorities.items() if k != first})
    assert [v.message for v in check_state(missing)] == [f"live seqs [{first}] have no priority"]
    assert "POLICY-6" not in clauses(check_state(dataclasses.replace(swapped, policy="lpm")))


@pytest.mark.clause("POLICY-15", "POLICY-6")
def test_a_prefill_cut_short_keeps_the_front_of_an_ordered_waiting() -> None:
    """POLICY-6's exception: a prefill cut short (holding blocks) may stand before a more urgent arrival; the same
    sequence without its blocks may not."""
    port = ReferencePort(config("priority", max_num_batched_tokens=8))
    port.add(port.new_sequence(list(range(20, 45)), 3), priority=5)
    out = port.schedule()
    port.postprocess(out.batch, [5], out.is_prefill)
    port.add(port.new_sequence([50, 51], 3), priority=0)
    state = port.snapshot()
    assert state.waiting[0].block_table and check_state(state) == []
    front = dataclasses.replace(state.waiting[0], block_table=[], num_cached_tokens=0)
    unheld = dataclasses.replace(state, waiting=[front, *state.waiting[1:]])
    assert "POLICY-6" in clauses(check_state(unheld))  # (and INV-2: its blocks' counts no longer match)


class Unordered(PriorityScheduler):
    """A variant that records priorities but queues by arrival, as the lesson does."""

    def _insert(self, queue: Any, seq: Sequence) -> None:
        queue.append(seq)


@pytest.mark.clause("POLICY-15", "POLICY-6")
def test_a_priority_scheduler_that_ignores_priorities_is_caught() -> None:
    """POLICY-6 on a real run: a variant keeping arrival order breaks it at once."""
    _, found = run(ReferencePort(config("priority"), lesson=Unordered), URGENCY)
    assert "POLICY-6" in clauses(found)


# --- lpm: POLICY-10 -----------------------------------------------------------------------------------------------
SHARED = [1] * 8  # two whole blocks, cached after the first request
STARVING: Arrivals = [[([*SHARED, 40], 1, 0)], [([30, 31, 32, 33, 34], 1, 0), ([*SHARED, 41], 1, 0)],
                      *([[([*SHARED, 42 + i], 1, 0)] for i in range(10)])]


def lpm_config(patience: int) -> SchedulerConfig:
    return config("lpm", num_blocks=12, max_num_seqs=1, max_num_batched_tokens=64, patience=patience)


class NoDue(LpmScheduler):
    """A variant without the due rule (the waiting ordered by cached prefix alone), patience 3."""

    def __init__(self, config: Any) -> None:
        super().__init__(config, 3)

    def _order_waiting(self) -> None:
        saved, self.patience = self.patience, 1 << 62
        try:
            super()._order_waiting()
        finally:
            self.patience = saved


@pytest.mark.clause("POLICY-15", "POLICY-10")
def test_the_starvation_bound_holds_and_its_absence_is_caught() -> None:
    """POLICY-10: lpm at patience 3 passes the loner over exactly 3 times and keeps every clause; the variant
    without the due rule passes it over more, which ``check_state`` reports."""
    states, found = run(ReferencePort(lpm_config(3)), STARVING)
    assert found == [] and max(max(s.passes.values(), default=0) for s in states) == 3
    assert all(s.policy == "lpm" and s.patience == 3 for s in states)
    _, found = run(ReferencePort(lpm_config(3), lesson=NoDue), STARVING)
    assert "POLICY-10" in clauses(found)


@pytest.mark.clause("POLICY-15", "POLICY-10")
def test_the_starvation_bound_corrupted_is_reported() -> None:
    """POLICY-10 on a snapshot: a count past patience, or negative, is reported; at patience it is not."""
    states, _ = run(ReferencePort(lpm_config(3)), STARVING[:3])
    state = next(s for s in states[1::2] if any(s.passes.values()))  # between steps
    loner = next(k for k, v in state.passes.items() if v)
    assert check_state(state) == []
    assert check_state(dataclasses.replace(state, passes={**state.passes, loner: 3})) == []
    for count in (4, -1):
        corrupted = dataclasses.replace(state, passes={**state.passes, loner: count})
        assert clauses(check_state(corrupted)) == {"POLICY-10"}
    assert check_state(dataclasses.replace(state, passes={loner: 4}, policy="mixed")) == []


# --- mixed: POLICY-2 ----------------------------------------------------------------------------------------------
MANY: Arrivals = [[([i, i + 1], 6, 0) for i in range(10, 18, 2)]] * 3


def mixed_config() -> SchedulerConfig:
    return config("mixed", num_blocks=64, max_num_seqs=8, max_num_batched_tokens=4)


class OverBudget(MixedScheduler):
    """A variant that gives prefill the whole budget, the decodes' tokens not counted."""

    def schedule(self) -> tuple[list[Sequence], bool]:
        decodes, preempted = self._decode()
        prefills = [] if preempted else self._prefill(self.max_num_batched_tokens, len(decodes))
        return decodes + prefills, bool(prefills)


@pytest.mark.clause("POLICY-15", "POLICY-2", "POLICY-3")
def test_the_running_bound_holds_and_its_absence_is_caught() -> None:
    """POLICY-2: a mixed run keeps every clause (the mixed batch clauses included) with running at the budget; the
    variant that does not count its decodes runs more than the budget and is reported."""
    states, found = run(ReferencePort(mixed_config()), MANY)
    assert found == [] and max(len(s.running) for s in states) == 4
    assert any(s.policy == "mixed" for s in states)
    _, found = run(ReferencePort(mixed_config(), lesson=OverBudget), MANY)
    assert {"POLICY-2", "INV-12"} <= clauses(found)


@pytest.mark.clause("POLICY-15", "POLICY-2", "POLICY-3")
def test_the_running_bound_and_the_mixed_batch_corrupted_are_reported() -> None:
    """POLICY-2 on a snapshot: a running queue longer than the budget is reported (not under the lesson, whose
    decode batch the budget does not bound); a mixed step's batch with its flag denied, or its cut-short prefill
    not last, is reported, as are a step over its budget (decodes included) and a decode of two tokens; the same mixed
    step read as the lesson's breaks INV-13 and INV-20."""
    port = ReferencePort(config("mixed", num_blocks=30, block_size=2, max_num_seqs=5, max_num_batched_tokens=8))
    for prompt in ([1, 2, 3], [4, 5, 6]):
        port.add(port.new_sequence(prompt, 5))
    out = port.schedule()
    port.postprocess(out.batch, [1] * len(out.batch), out.is_prefill)
    for prompt in ([7, 8], [9] * 9):
        port.add(port.new_sequence(prompt, 5))
    out = port.schedule()
    state, views = port.snapshot(), [seq_view(s) for s in out.batch]
    assert [(v.is_prefill, v.num_scheduled_tokens) for v in views] == [(False, 1), (False, 1), (True, 2), (True, 4)]
    assert check_state(state, between_steps=False) == [] and check_batch(state, views, True) == []
    assert clauses(check_batch(state, views, False)) == {"POLICY-2"}
    assert "POLICY-3" in clauses(check_batch(state, [views[0], views[1], views[3], views[2]], True))
    over = dataclasses.replace(state, max_num_batched_tokens=7)  # the decodes count toward the budget
    assert {"INV-12", "POLICY-3"} <= clauses(check_batch(over, views, True))
    two = [dataclasses.replace(views[0], num_scheduled_tokens=2, num_cached_tokens=views[0].num_tokens - 2), *views[1:]]
    assert "INV-14" in clauses(check_batch(state, two, True))  # a decode of two tokens
    assert {"INV-13", "INV-20"} <= clauses(check_batch(dataclasses.replace(state, policy="lesson"), views, True))
    narrow = dataclasses.replace(state, max_num_batched_tokens=2)
    assert "POLICY-2" in clauses(check_state(narrow, between_steps=False))
    assert "POLICY-2" not in clauses(check_state(dataclasses.replace(narrow, policy="lesson"), between_steps=False))


# --- the snapshot of a bare reference -----------------------------------------------------------------------------
@pytest.mark.clause("POLICY-15")
def test_a_bare_references_snapshot_names_its_policy() -> None:
    """``invariants.snapshot`` reads a bare policy reference's fields duck-typed: priority's priorities, lpm's
    passes of the waiting and its patience; mixed keeps nothing to tell it by and is named by the caller."""
    port = ReferencePort(config("lpm", patience=5))
    seq = port.new_sequence([1, 2], 2)
    port.add(seq)
    assert (snapshot(port.lesson_scheduler).policy, snapshot(port.lesson_scheduler).passes) == ("lpm", {seq.seq_id: 0})
    assert port.snapshot().patience == 5
    prio = ReferencePort(config("priority"))
    other = prio.new_sequence([1, 2], 2)
    prio.add(other, priority=-4)
    assert snapshot(prio.lesson_scheduler).priorities == {other.seq_id: -4}
    assert snapshot(ReferencePort(mixed_config()).lesson_scheduler).policy == "lesson"
    assert snapshot(ReferencePort(mixed_config()).lesson_scheduler, "mixed").policy == "mixed"
