"""The policies' references (spec/policies.md, POLICY-1..10): each driven by random workloads beside the lesson's
scheduler, the shared invariants checked after every step, and each policy's own rule checked as it decides."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from invariants import check_state
from invariants.state import snapshot
from reference.config import SchedulerConfig
from reference.lpm_scheduler import LpmScheduler, cached_prefix_blocks
from reference.mixed_scheduler import MixedScheduler
from reference.priority_scheduler import PriorityScheduler
from reference.scheduler import Scheduler
from reference.sequence import SamplingParams, Sequence

BLOCK = 4
PREFIXES = ([1] * 8, [2] * 8, [3] * 12)  # shared system prompts, whole blocks


@dataclass(frozen=True)
class Arrival:
    prefix: int  # which of PREFIXES, or -1 for none
    tail: tuple[int, ...]
    max_tokens: int
    priority: int


@dataclass
class Workload:
    config: SchedulerConfig
    steps: list[list[Arrival]]  # the arrivals before each step
    tokens: list[int] = field(default_factory=list)  # drawn tokens, cycled


def arrivals() -> st.SearchStrategy[Arrival]:
    return st.builds(Arrival, st.integers(-1, len(PREFIXES) - 1),
                     st.lists(st.integers(10, 40), min_size=1, max_size=14).map(tuple),
                     st.integers(1, 8), st.integers(0, 3))


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    config = SchedulerConfig(num_blocks=draw(st.integers(12, 40)), block_size=BLOCK,
                             max_num_seqs=draw(st.integers(1, 8)), max_num_batched_tokens=draw(st.integers(2, 32)),
                             eos=7)
    steps = draw(st.lists(st.lists(arrivals(), max_size=3), min_size=1, max_size=12))
    return Workload(config, steps, draw(st.lists(st.integers(5, 9), min_size=1, max_size=20)))


def prompt_of(arrival: Arrival) -> list[int]:
    return (list(PREFIXES[arrival.prefix]) if arrival.prefix >= 0 else []) + list(arrival.tail)


def fits(arrival: Arrival, config: SchedulerConfig) -> bool:
    """What an engine admits (ENG-10): the whole request fits the cache alone, so no step can be empty (EDGE-2)."""
    return len(prompt_of(arrival)) + arrival.max_tokens <= config.num_blocks * config.block_size


@dataclass
class Decision:
    batch: list[tuple[int, int, list[int]]]
    is_prefill: bool


@dataclass(frozen=True)
class Before:
    """What the observer knows of the state before the step."""

    running: list[int]  # seq_ids of the running sequences
    held: dict[int, list[int]]  # seq_id -> block table, of every live sequence holding blocks


Observer = Callable[[Any, list[Sequence], bool, Before], None]


def drive(scheduler: Scheduler, workload: Workload, observe: Observer | None = None,
          with_priority: bool = False, idle_steps: int = 3000) -> list[Decision]:
    """Run ``workload`` through ``scheduler``: its arrivals before each step, then steps until all finish; the
    shared invariants (every state clause but the lesson's FIFO order, INV-6) checked after every postprocess."""
    decisions: list[Decision] = []
    arrived: dict[int, Arrival] = {}
    draws = iter(workload.tokens * 10_000)
    pending = list(workload.steps) + [[]] * idle_steps
    for step_arrivals in pending:
        for arrival in step_arrivals:
            if not fits(arrival, workload.config):
                continue
            seq = Sequence(prompt_of(arrival), SamplingParams(max_tokens=arrival.max_tokens), BLOCK)
            arrived[seq.seq_id] = arrival
            if with_priority:
                assert isinstance(scheduler, PriorityScheduler)
                scheduler.add(seq, arrival.priority)
            else:
                scheduler.add(seq)
        if scheduler.is_finished():
            if step_arrivals or any(pending):
                continue
            break
        live = [*scheduler.running, *scheduler.waiting]
        before = Before([s.seq_id for s in scheduler.running],
                        {s.seq_id: list(s.block_table) for s in live if s.block_table})
        batch, is_prefill = scheduler.schedule()
        decisions.append(Decision([(s.seq_id, s.num_scheduled_tokens, list(s.block_table)) for s in batch],
                                  is_prefill))
        if observe is not None:
            observe(scheduler, batch, is_prefill, before)
        scheduler.postprocess(batch, [next(draws) for _ in batch], is_prefill)
        found = [v for v in check_state(snapshot(scheduler)) if v.clause != "INV-6"]
        assert not found, found
    assert scheduler.is_finished(), "the workload did not drain"
    return decisions


def same_ids(decisions: list[Decision]) -> list[tuple[list[tuple[int, int, list[int]]], bool]]:
    """Decisions with seq_ids made relative to the first one (two runs create their own sequences)."""
    first = min((e[0] for d in decisions for e in d.batch), default=0)
    return [([(i - first, n, t) for i, n, t in d.batch], d.is_prefill) for d in decisions]


# --- shared invariants, and the reductions to the lesson ----------------------------------------------------
@pytest.mark.clause("POLICY-1")
@settings(max_examples=40, deadline=None)
@given(workloads())
def test_every_policy_keeps_the_shared_invariants(workload: Workload) -> None:
    """POLICY-1: under every policy, after every step, the state clauses hold (blocks, refcounts, prefix table,
    counters, queues) but the lesson's FIFO order; and every workload drains."""
    drive(MixedScheduler(workload.config), workload)
    drive(PriorityScheduler(workload.config), workload, with_priority=True)
    drive(LpmScheduler(workload.config), workload)


@pytest.mark.clause("POLICY-5")
@settings(max_examples=40, deadline=None)
@given(workloads())
def test_priority_with_one_priority_is_the_lesson(workload: Workload) -> None:
    """POLICY-5: with every priority 0 the priority policy decides every step exactly as the lesson's scheduler."""
    flat = Workload(workload.config, [[Arrival(a.prefix, a.tail, a.max_tokens, 0) for a in s] for s in workload.steps],
                    workload.tokens)
    lesson = drive(Scheduler(flat.config), flat)
    assert same_ids(drive(PriorityScheduler(flat.config), flat, with_priority=True)) == same_ids(lesson)


@pytest.mark.clause("POLICY-8")
@settings(max_examples=40, deadline=None)
@given(workloads())
def test_lpm_with_no_patience_is_the_lesson(workload: Workload) -> None:
    """POLICY-8: with patience 0 every waiting request is due at once, so lpm decides exactly as the lesson."""
    lesson = drive(Scheduler(workload.config), workload)
    assert same_ids(drive(LpmScheduler(workload.config, patience=0), workload)) == same_ids(lesson)


# --- mixed ------------------------------------------------------------------------------------------------------
def _mixed_rules(scheduler: Any, batch: list[Sequence], is_prefill: bool, before: Before) -> None:
    budget = scheduler.max_num_batched_tokens
    assert sum(s.num_scheduled_tokens for s in batch) <= budget  # POLICY-2: decodes count too
    assert len(batch) <= scheduler.max_num_seqs
    decodes = [s for s in batch if not s.is_prefill]
    prefills = [s for s in batch if s.is_prefill]
    assert batch == decodes + prefills  # decodes first
    assert all(s.num_scheduled_tokens == 1 for s in decodes)
    cut = [s for s in prefills if s.num_cached_tokens + s.num_scheduled_tokens < s.num_tokens]
    assert cut in ([], prefills[-1:])  # POLICY-3: only the last prefill may be cut short
    if cut:
        assert scheduler.waiting[0] is cut[0]
        assert sum(s.num_scheduled_tokens for s in batch) == budget  # and only because the budget ran out
    assert is_prefill == bool(prefills)
    now = {s.seq_id: s for s in [*scheduler.running, *scheduler.waiting]}
    lost = [i for i, table in before.held.items()  # a table only grows, unless its blocks were let go
            if i in now and now[i].block_table[: len(table)] != table]
    if lost:  # someone was preempted: no prefill this step, so it is not taken straight back either
        assert not prefills, (lost, [s.seq_id for s in prefills])
    assert len(scheduler.running) <= budget  # what makes the decode loop's budget hold (POLICY-2)


@pytest.mark.clause("POLICY-2")
@pytest.mark.clause("POLICY-3")
@settings(max_examples=40, deadline=None)
@given(workloads())
def test_mixed_decodes_first_and_fills_the_budget_with_chunks(workload: Workload) -> None:
    """POLICY-2, POLICY-3: every step's tokens, decodes included, stay within the budget; decodes come first, one
    token each; only the last prefill is cut short, when the budget runs out, and it waits at the front."""
    drive(MixedScheduler(workload.config), workload, _mixed_rules)


@pytest.mark.clause("POLICY-3")
def test_mixed_takes_nothing_back_in_the_step_that_let_it_go() -> None:
    """POLICY-3: a partly prefilled request whose prefix blocks are also held by a running one loses its own blocks
    to a decode; it would fit again at once, yet the step that preempted admits nothing. (Found by a search
    against the rule removed, which takes it straight back in the same step.)"""
    config = SchedulerConfig(num_blocks=5, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=9, eos=-1)
    steps = [[], [Arrival(-1, (1, 2, 3, 4, 15, 16, 10, 11), 5, 0), Arrival(-1, (1, 2, 3, 4, 5, 6, 7, 8, 12, 10), 2, 0)],
             [Arrival(-1, (1, 2, 3, 4, 10, 20), 4, 0), Arrival(-1, (1, 2, 3, 4, 11, 15, 14, 15), 6, 0)],
             [Arrival(-1, (15,), 6, 0), Arrival(-1, (1, 2, 3, 4, 5, 6, 7, 8, 12), 5, 0)]]
    drive(MixedScheduler(config), Workload(config, steps, [5]), _mixed_rules)


@pytest.mark.clause("POLICY-4")
def test_mixed_keeps_decoding_while_a_long_prompt_is_prefilled() -> None:
    """POLICY-4: two requests decode; a 40-token prompt arrives; budget 16. The lesson stalls both decodes for
    the steps of its chunks (the negative control); mixed decodes both in each of those steps."""
    config = SchedulerConfig(num_blocks=40, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=16, eos=-1)
    short = [Arrival(-1, (11, 12, 13), 12, 0), Arrival(-1, (14, 15, 16), 12, 0)]
    long_prompt = Arrival(-1, tuple(range(10, 50)), 2, 0)
    for policy, stalls in ((Scheduler, True), (MixedScheduler, False)):
        chunk_steps: list[tuple[int, int]] = []  # (decodes in the step, running before it) while the prompt fills

        def watch(s: Any, batch: list[Sequence], is_prefill: bool, before: Before,
                  chunk_steps: list[tuple[int, int]] = chunk_steps) -> None:
            chunk = [q for q in batch if q.num_prompt_tokens == 40 and q.is_prefill]
            if chunk:
                chunk_steps.append((sum(1 for q in batch if not q.is_prefill), len(before.running)))

        drive(policy(config), Workload(config, [short, [], [long_prompt]], [5]), watch)
        assert len(chunk_steps) >= 3 and all(before == 2 for _, before in chunk_steps), chunk_steps
        assert all(decodes == (0 if stalls else 2) for decodes, _ in chunk_steps), (policy.__name__, chunk_steps)


# --- priority -----------------------------------------------------------------------------------------------------
def _priority_rules(scheduler: Any, batch: list[Sequence], is_prefill: bool, before: Before) -> None:
    keys = [scheduler.key(s) for s in scheduler.running]
    assert keys == sorted(keys)  # POLICY-6: running in (priority, arrival) order
    waiting = list(scheduler.waiting)
    rest = waiting[1:] if waiting and waiting[0].block_table else waiting
    assert [scheduler.key(s) for s in rest] == sorted(scheduler.key(s) for s in rest)


@pytest.mark.clause("POLICY-6")
@settings(max_examples=40, deadline=None)
@given(workloads())
def test_priority_orders_both_queues(workload: Workload) -> None:
    """POLICY-6: right after every schedule(), running and waiting (past a partly prefilled front) are in
    (priority, arrival) order."""
    drive(PriorityScheduler(workload.config), workload, _priority_rules, with_priority=True)


@pytest.mark.clause("POLICY-7")
def test_priority_admits_the_urgent_first_and_preempts_the_least_urgent() -> None:
    """POLICY-7: of two waiting requests the lower priority value is prefilled first though it arrived later; when
    blocks run out, the least urgent running request is preempted, not the newest."""
    config = SchedulerConfig(num_blocks=6, block_size=BLOCK, max_num_seqs=1, max_num_batched_tokens=64, eos=-1)
    scheduler = PriorityScheduler(config)
    late = Sequence([1, 2, 3], SamplingParams(max_tokens=4), BLOCK)
    urgent = Sequence([4, 5, 6], SamplingParams(max_tokens=4), BLOCK)
    scheduler.add(late, priority=2)
    scheduler.add(urgent, priority=0)
    batch, _ = scheduler.schedule()
    assert batch == [urgent]
    config = SchedulerConfig(num_blocks=3, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=64, eos=-1)
    scheduler = PriorityScheduler(config)
    low = Sequence([1, 2, 3, 4], SamplingParams(max_tokens=8), BLOCK)
    high = Sequence([5, 6, 7, 8], SamplingParams(max_tokens=8), BLOCK)
    scheduler.add(low, priority=5)
    scheduler.add(high, priority=1)
    batch, is_prefill = scheduler.schedule()
    assert batch == [high, low]
    scheduler.postprocess(batch, [9, 9], is_prefill)
    batch, _ = scheduler.schedule()  # both need a second block, one is free: the less urgent goes
    assert batch == [high] and list(scheduler.waiting) == [low] and not low.block_table
    with pytest.raises(ValueError, match="priority must be an int"):
        scheduler.add(Sequence([1], SamplingParams(), BLOCK), priority=True)


@pytest.mark.clause("POLICY-6")
def test_a_partly_prefilled_request_keeps_the_front_when_an_urgent_one_arrives() -> None:
    """POLICY-6: the prefill cut short holds blocks; an urgent arrival waits behind it, never before it."""
    config = SchedulerConfig(num_blocks=20, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=8, eos=-1)
    scheduler = PriorityScheduler(config)
    long_one = Sequence(list(range(10, 30)), SamplingParams(max_tokens=2), BLOCK)
    scheduler.add(long_one, priority=3)
    batch, is_prefill = scheduler.schedule()
    scheduler.postprocess(batch, [5], is_prefill)
    urgent = Sequence([1, 2, 3], SamplingParams(max_tokens=2), BLOCK)
    scheduler.add(urgent, priority=0)
    assert list(scheduler.waiting) == [long_one, urgent]
    batch, _ = scheduler.schedule()
    assert batch == [long_one] and long_one.num_scheduled_tokens == 8


# --- lpm ----------------------------------------------------------------------------------------------------------
def _starvation_bound(scheduler: Any, batch: list[Sequence], is_prefill: bool, before: Before) -> None:
    assert max(scheduler.passes.values(), default=0) <= scheduler.patience


@pytest.mark.clause("POLICY-10")
@settings(max_examples=40, deadline=None)
@given(workloads(), st.integers(0, 4))
def test_lpm_passes_nobody_over_more_than_its_patience(workload: Workload, patience: int) -> None:
    """POLICY-10: no waiting request is passed over (a later arrival given its first chunk while it waits) more
    than ``patience`` times."""
    drive(LpmScheduler(workload.config, patience=patience), workload, _starvation_bound)


def _starving_workload() -> Workload:
    """A request with no shared prefix, then a stream of requests whose prefix is cached, one per step."""
    config = SchedulerConfig(num_blocks=12, block_size=BLOCK, max_num_seqs=1, max_num_batched_tokens=64, eos=-1)
    loner = Arrival(-1, (30, 31, 32, 33, 34), 1, 0)
    sharer = Arrival(0, (40,), 1, 0)
    return Workload(config, [[sharer], [loner, sharer]] + [[sharer]] * 12, [5])


@pytest.mark.clause("POLICY-10")
def test_without_the_due_rule_lpm_starves_a_request() -> None:
    """POLICY-10's negative control: with a patience too large to matter, the loner is passed over by every
    request of the stream (12 times here); with the default patience, at most that many."""
    counts = []
    for patience in (10**9, 3):
        scheduler = LpmScheduler(_starving_workload().config, patience=patience)
        seen: list[int] = []

        def watch(s: Any, batch: list[Sequence], is_prefill: bool, before: Before, seen: list[int] = seen) -> None:
            seen.append(max(s.passes.values(), default=0))

        drive(scheduler, _starving_workload(), watch)
        counts.append(max(seen))
    assert counts[0] >= 10 and counts[1] == 3


@pytest.mark.clause("POLICY-9")
def test_lpm_takes_the_cached_prefix_first_and_hits_more() -> None:
    """POLICY-9: with the prefix of request 0 cached, a later request sharing it is prefilled before an earlier
    one that does not, and over the workload lpm reuses more cached blocks than the lesson."""
    def hits(policy: type[Scheduler]) -> int:
        total = 0

        def count(s: Any, batch: list[Sequence], is_prefill: bool, before: Before) -> None:
            nonlocal total
            if is_prefill:
                total += sum(q.num_cached_tokens for q in batch)

        # 4 blocks, 3 a request: taking fresh blocks for one prefix evicts the other's
        config = SchedulerConfig(num_blocks=4, block_size=BLOCK, max_num_seqs=1, max_num_batched_tokens=64, eos=-1)
        first = [Arrival(0, (41,), 1, 0)]
        mixed_arrivals = [Arrival(1, (50 + i,), 1, 0) if i % 2 else Arrival(0, (60 + i,), 1, 0) for i in range(8)]
        drive(policy(config), Workload(config, [first, mixed_arrivals], [5]), count)
        return total

    lpm, lesson = hits(LpmScheduler), hits(Scheduler)
    assert lpm > lesson, (lpm, lesson)
    config = SchedulerConfig(num_blocks=20, block_size=BLOCK, max_num_seqs=1, max_num_batched_tokens=64, eos=-1)
    scheduler = LpmScheduler(config)
    warm = Sequence(PREFIXES[0] + [41], SamplingParams(max_tokens=1), BLOCK)
    scheduler.add(warm)
    batch, is_prefill = scheduler.schedule()
    scheduler.postprocess(batch, [5], is_prefill)
    other = Sequence([70, 71, 72, 73, 74], SamplingParams(max_tokens=1), BLOCK)
    sharer = Sequence(PREFIXES[0] + [42], SamplingParams(max_tokens=1), BLOCK)
    scheduler.add(other)
    scheduler.add(sharer)
    assert cached_prefix_blocks(scheduler.block_manager, sharer) == 2
    batch, _ = scheduler.schedule()
    assert batch == [sharer] and scheduler.passes[other.seq_id] == 1


@pytest.mark.clause("POLICY-10")
def test_lpm_refuses_a_bad_patience() -> None:
    config = SchedulerConfig(num_blocks=4, block_size=BLOCK)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="patience must be an int >= 0"):
            LpmScheduler(config, patience=bad)  # type: ignore[arg-type]
