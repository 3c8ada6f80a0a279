"""The reference state machine under the ``ci`` profile, and the step contract it checks, shown to bite.

``TestReferenceMachine`` runs optimized/verify/machines/reference_machine.py: requests
arrive and steps run on the reference scheduler, with the step contract and
every state invariant checked throughout. The other tests take one real step,
corrupt what it produced, and see the right clause reported, so the checks
cannot pass vacuously.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from functools import partial

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

import reference
from invariants import SchedulerState, SeqView, seq_view, snapshot
from optimized.verify.machines import Stats, counting
from optimized.verify.machines.reference_machine import Machine, StepFailed
from optimized.verify.machines.step_contract import (
    can_allocate,
    chain_hashes,
    check_postprocess,
    check_schedule,
)
from reference import BlockManager, SamplingParams, Scheduler, SchedulerConfig, Sequence
from tests.scheduler_fixtures import make_scheduler

TestReferenceMachine = Machine.TestCase


class OptimizedMachine(Machine):
    """The same users and contracts, on the optimized scheduler through the same port (ARCH-4)."""

    IMPLEMENTATION = "optimized"


TestOptimizedUnderTheStepContract = OptimizedMachine.TestCase


@dataclasses.dataclass
class Step:
    before: SchedulerState
    scheduled: SchedulerState
    batch: list[SeqView]
    is_prefill: bool
    tokens: list[int]
    after: SchedulerState


make = partial(make_scheduler, eos=9)


def add(s: Scheduler, tokens: list[int], max_tokens: int = 8) -> Sequence:
    seq = Sequence(tokens, SamplingParams(max_tokens=max_tokens), 4)
    s.add(seq)
    return seq


def take_step(s: Scheduler, token: int = 1) -> Step:
    before = snapshot(s)
    batch, is_prefill = s.schedule()
    scheduled = snapshot(s)
    views = [seq_view(x) for x in batch]
    tokens = [token] * len(batch)
    s.postprocess(batch, tokens, is_prefill)
    return Step(before, scheduled, views, is_prefill, tokens, snapshot(s))


def schedule_clauses(step: Step) -> set[str]:
    return {v.clause for v in check_schedule(step.before, step.scheduled, step.batch, step.is_prefill)}


def post_clauses(step: Step, ignore_eos: bool = False) -> set[str]:
    flags = {x.seq_id: ignore_eos for x in step.batch}
    return {v.clause for v in check_postprocess(step.scheduled, step.after, step.batch, step.tokens,
                                                step.is_prefill, 9, flags)}


def corrupt(step: Step, change: Callable[[Step], None]) -> Step:
    bad = copy.deepcopy(step)
    change(bad)
    return bad


def prefill_step() -> Step:
    s = make(num_blocks=16)
    for start in (10, 20, 30):
        add(s, list(range(start, start + 5)))
    return take_step(s)


# The machine's clauses on clean steps.

@pytest.mark.clause("SCHED-1")
def test_clean_steps_break_no_clause() -> None:
    """SCHED-1: a real prefill step and a real preempting decode step satisfy the whole step contract."""
    for step in (prefill_step(), decode_with_victim()):
        assert schedule_clauses(step) == set()
        assert post_clauses(step) == set()


def decode_with_victim() -> Step:
    """a and b running with one full block each; the cache is full; a opens a block, so b is preempted."""
    s = make(num_blocks=2)
    add(s, [1, 2, 3, 4], max_tokens=3)
    add(s, [5, 6, 7, 8], max_tokens=3)
    take_step(s)
    step = take_step(s)
    assert not step.is_prefill and [x.seq_id for x in step.batch] == [step.before.running[0].seq_id]
    assert [x.seq_id for x in step.scheduled.waiting] == [step.before.running[1].seq_id]
    return step


# Prefill decisions.

@pytest.mark.clause("PREFILL-1")
def test_a_prefill_batch_out_of_queue_order_is_reported() -> None:
    """PREFILL-1: the batch is the front of waiting, in order."""
    bad = corrupt(prefill_step(), lambda st: st.batch.reverse())
    assert "PREFILL-1" in schedule_clauses(bad)


@pytest.mark.clause("PREFILL-2")
def test_a_scan_that_stops_without_a_reason_is_reported() -> None:
    """PREFILL-2: dropping the last sequence of the batch leaves one that fitted budget and blocks."""
    def drop_last(st: Step) -> None:
        last = st.batch.pop()
        st.scheduled.running = [x for x in st.scheduled.running if x.seq_id != last.seq_id]
        st.scheduled.waiting.insert(0, dataclasses.replace(last, status="WAITING", block_table=[]))
        st.scheduled.free_block_ids.extend(last.block_table)
        st.scheduled.used_block_ids -= set(last.block_table)
    assert "PREFILL-2" in schedule_clauses(corrupt(prefill_step(), drop_last))


@pytest.mark.clause("PREFILL-3", "PREFILL-4")
def test_budget_breaks_are_not_reported() -> None:
    """PREFILL-3, PREFILL-4: a scan stopped by a spent budget or a failed can_allocate is sound."""
    s = make(num_blocks=16, budget=10)
    for start in (10, 20, 30):
        add(s, list(range(start, start + 5)))
    spent = take_step(s)
    assert len(spent.batch) == 2 and schedule_clauses(spent) == set()
    s = make(num_blocks=2)
    add(s, [1, 2, 3])
    add(s, list(range(10, 20)))  # needs 3 blocks of the 1 left
    no_blocks = take_step(s)
    assert len(no_blocks.batch) == 1 and schedule_clauses(no_blocks) == set()


@pytest.mark.clause("PREFILL-5")
def test_wrong_token_counts_are_reported() -> None:
    """PREFILL-5: num_scheduled_tokens = min(needed, remaining)."""
    def shave(st: Step) -> None:
        st.batch[1].num_scheduled_tokens -= 1
    assert "PREFILL-5" in schedule_clauses(corrupt(prefill_step(), shave))


@pytest.mark.clause("CHUNK-1")
def test_a_second_chunked_sequence_is_reported() -> None:
    """CHUNK-1: only the first sequence may be given fewer tokens than it needs."""
    s = make(num_blocks=16, budget=8)
    add(s, list(range(10, 16)))
    add(s, list(range(20, 26)))
    step = take_step(s)
    assert len(step.batch) == 1 and schedule_clauses(step) == set()

    def chunk_second(st: Step) -> None:
        second = dataclasses.replace(st.scheduled.waiting[0], num_scheduled_tokens=2, block_table=[9, 10])
        st.batch.append(second)
    assert "CHUNK-1" in schedule_clauses(corrupt(step, chunk_second))


@pytest.mark.clause("CHUNK-2")
def test_a_chunk_reallocated_midway_is_reported() -> None:
    """CHUNK-2: a chunk in progress keeps its blocks and its cached tokens."""
    s = make(num_blocks=16, budget=4)
    add(s, list(range(10, 20)))
    take_step(s)
    step = take_step(s)
    assert step.is_prefill and schedule_clauses(step) == set()
    bad = corrupt(step, lambda st: st.batch[0].block_table.reverse())
    assert "CHUNK-2" in schedule_clauses(bad)


@pytest.mark.clause("BM-4")
def test_missed_prefix_hits_are_reported() -> None:
    """BM-4: the first fresh sequence starts with exactly its prefix-cache hits computed."""
    s = make(num_blocks=16)
    add(s, list(range(10, 19)))
    take_step(s)
    add(s, list(range(10, 19)))
    step = take_step(s)
    assert step.batch[0].num_cached_tokens == 8 and schedule_clauses(step) == set()

    def miss(st: Step) -> None:
        st.batch[0].num_cached_tokens = 0
        st.batch[0].num_scheduled_tokens = 9
    assert "BM-4" in schedule_clauses(corrupt(step, miss))


@pytest.mark.clause("BM-4")
def test_missed_prefix_hits_of_a_later_sequence_are_reported() -> None:
    """BM-4: every fresh sequence of the batch starts with its hits, not only the first."""
    s = make(num_blocks=16)
    add(s, list(range(10, 19)))
    take_step(s)
    add(s, list(range(40, 45)))
    add(s, list(range(10, 19)))
    step = take_step(s)
    assert [x.num_cached_tokens for x in step.batch] == [0, 8] and schedule_clauses(step) == set()

    def under_report(st: Step) -> None:
        st.batch[1].num_cached_tokens = 4  # a multiple of block_size: only the recomputed lookup can tell
        st.batch[1].num_scheduled_tokens = 5
    assert "BM-4" in schedule_clauses(corrupt(step, under_report))


@pytest.mark.clause("BM-4", "CACHE-3")
def test_hits_are_looked_up_after_the_earlier_allocations_of_the_scan() -> None:
    """BM-4, CACHE-3: a block the first sequence takes fresh is no longer a hit for the second."""
    s = make(num_blocks=4)
    add(s, [1, 2, 3, 4], max_tokens=1)  # block 0, hashed, then released
    add(s, list(range(20, 28)), max_tokens=1)  # blocks 1 and 2
    take_step(s)
    assert list(s.block_manager.free_block_ids) == [3, 0, 2, 1]
    add(s, list(range(40, 48)))  # takes 3 and 0: block 0 is overwritten
    add(s, [1, 2, 3, 4, 5])  # a hit on block 0 in the state before the step, none after the first allocation
    assert can_allocate(snapshot(s), [1, 2, 3, 4, 5]) == 1
    step = take_step(s)
    assert [x.num_cached_tokens for x in step.batch] == [0, 0] and schedule_clauses(step) == set()

    def stale_hit(st: Step) -> None:
        st.batch[1].num_cached_tokens = 4
        st.batch[1].num_scheduled_tokens = 1
    assert "BM-4" in schedule_clauses(corrupt(step, stale_hit))


@pytest.mark.clause("PREFILL-6")
def test_prefilled_sequences_in_the_wrong_queue_are_reported() -> None:
    """PREFILL-6: a completed prefill moves to the tail of running as RUNNING."""
    def stay(st: Step) -> None:
        st.scheduled.running = st.scheduled.running[:-1]
    assert "PREFILL-6" in schedule_clauses(corrupt(prefill_step(), stay))


@pytest.mark.clause("SCHED-2")
def test_a_decode_step_while_the_head_fits_is_reported() -> None:
    """SCHED-2: prefill first."""
    s = make(num_blocks=16)
    add(s, [1, 2, 3])
    take_step(s)
    add(s, [4, 5, 6])
    before = snapshot(s)
    running = seq_view(s.running[0])
    decode = dataclasses.replace(running, num_scheduled_tokens=1, is_prefill=False)
    assert "SCHED-2" in {v.clause for v in check_schedule(before, before, [decode], False)}


# Decode decisions.

@pytest.mark.clause("DECODE-1", "DECODE-3", "PREEMPT-1", "PREEMPT-3", "EDGE-2")
def test_decode_corruptions_are_reported() -> None:
    """DECODE-1, DECODE-3, PREEMPT-1, PREEMPT-3, EDGE-2 on a step that preempted its newest sequence."""
    step = decode_with_victim()

    def two_tokens(st: Step) -> None:
        st.batch[0].num_scheduled_tokens = 2
    assert "DECODE-1" in schedule_clauses(corrupt(step, two_tokens))

    def victim_keeps_blocks(st: Step) -> None:
        st.scheduled.waiting[0].block_table = [1]
    assert "PREEMPT-1" in schedule_clauses(corrupt(step, victim_keeps_blocks))

    def victim_at_the_back(st: Step) -> None:
        st.before.waiting = [seq_view(Sequence([7], SamplingParams(), 4))]
        st.scheduled.waiting = [st.before.waiting[0], st.scheduled.waiting[0]]
    assert "PREEMPT-3" in schedule_clauses(corrupt(step, victim_at_the_back))

    def running_reordered(st: Step) -> None:
        st.scheduled.running = [st.scheduled.running[0], st.scheduled.running[0]]
    assert "DECODE-3" in schedule_clauses(corrupt(step, running_reordered))

    assert "EDGE-2" in schedule_clauses(corrupt(step, lambda st: st.batch.clear()))


@pytest.mark.clause("PREEMPT-2", "DECODE-2")
def test_the_wrong_victim_is_reported() -> None:
    """PREEMPT-2, DECODE-2: the newest is preempted, and only for a sequence that needs a block."""
    s = make(num_blocks=16, max_num_seqs=1)
    for start in (10, 20, 30):
        add(s, list(range(start, start + 3)))
    while len(s.running) < 3:
        take_step(s)
    step = take_step(s)  # decode a; b and c are left alone (max_num_seqs 1)
    assert schedule_clauses(step) == set()
    b = step.before.running[1]

    def oldest_victim(st: Step) -> None:
        st.scheduled.running = [st.scheduled.running[0], st.scheduled.running[2]]
        st.scheduled.waiting = [dataclasses.replace(b, status="WAITING", is_prefill=True, block_table=[],
                                                    num_cached_tokens=0)]
    assert {"PREEMPT-2", "DECODE-2"} <= schedule_clauses(corrupt(step, oldest_victim))

    def untouched_with_room(st: Step) -> None:
        st.before.max_num_seqs = st.scheduled.max_num_seqs = 3
    assert "DECODE-2" in schedule_clauses(corrupt(step, untouched_with_room))


@pytest.mark.clause("DECODE-2")
def test_a_preemption_while_a_block_is_free_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """DECODE-2: preemption happens only when a block is needed and none is free."""
    def greedy_can_append(self: BlockManager, seq: Sequence) -> bool:
        return len(self.free_block_ids) >= 2 * (len(seq) % self.block_size == 1)  # one block is not enough

    s = make(num_blocks=4)
    add(s, [1, 2, 3, 4])
    add(s, [5, 6, 7, 8])
    take_step(s)  # a and b have length 5 and one block each; two blocks are free
    honest = take_step(copy.deepcopy(s))  # a and b take one free block each; nobody is preempted
    assert not honest.scheduled.waiting and schedule_clauses(honest) == set()
    monkeypatch.setattr(BlockManager, "can_append", greedy_can_append)
    step = take_step(s)  # a takes one of two; b, alone, finds one free but wants two: it preempts itself
    assert [x.seq_id for x in step.scheduled.waiting] == [step.before.running[1].seq_id]
    assert "DECODE-2" in schedule_clauses(step)


# Postprocess.

@pytest.mark.clause("POST-1", "POST-3", "CACHE-2")
def test_postprocess_corruptions_are_reported() -> None:
    """POST-1, POST-3, CACHE-2 on a real prefill step."""
    step = prefill_step()

    def counters(st: Step) -> None:
        st.after.running[0].num_cached_tokens = 0
    assert "POST-1" in post_clauses(corrupt(step, counters))

    def no_token(st: Step) -> None:
        st.after.running[0].token_ids.pop()
    assert "POST-3" in post_clauses(corrupt(step, no_token))

    def unhashed(st: Step) -> None:
        block = st.batch[0].block_table[0]
        st.after.blocks[block].hash = -1
    assert "CACHE-2" in post_clauses(corrupt(step, unhashed))

    # Finishing on EOS, unless ignore_eos.
    eos_step = dataclasses.replace(prefill_step(), tokens=[9, 9, 9])
    assert "POST-3" in post_clauses(eos_step)


@pytest.mark.clause("POST-3")
def test_a_running_sequence_lost_outside_the_batch_is_reported() -> None:
    """POST-3: postprocess changes no other queue position; a running sequence outside the batch stays."""
    s = make(num_blocks=16)
    add(s, [1, 2, 3])
    take_step(s)
    add(s, [4, 5, 6])
    step = take_step(s)  # prefill b while a, running, is not in the batch
    assert len(step.batch) == 1 and len(step.after.running) == 2 and post_clauses(step) == set()

    def lose_a(st: Step) -> None:
        st.after.running = st.after.running[1:]
    assert "POST-3" in post_clauses(corrupt(step, lose_a))


@pytest.mark.clause("POST-2")
def test_a_kept_chunk_sample_is_reported() -> None:
    """POST-2: an unfinished chunk's sample is discarded."""
    s = make(num_blocks=16, budget=4)
    add(s, list(range(10, 20)))
    step = take_step(s, token=5)
    assert post_clauses(step) == set()

    def kept(st: Step) -> None:
        st.after.waiting[0].token_ids.append(5)
    assert "POST-2" in post_clauses(corrupt(step, kept))


# The restated prefix-cache lookup agrees with the reference's.

@pytest.mark.clause("BM-3", "CACHE-1", "CACHE-4")
@settings(suppress_health_check=[HealthCheck.too_slow])
@given(block_size=st.integers(2, 5), num_blocks=st.integers(1, 8),
       prompts=st.lists(st.lists(st.integers(1, 2), min_size=1, max_size=12), min_size=1, max_size=6),
       probe=st.lists(st.integers(1, 2), min_size=1, max_size=12))
def test_restated_can_allocate_agrees_with_the_reference(block_size: int, num_blocks: int,
                                                         prompts: list[list[int]], probe: list[int]) -> None:
    """BM-3, CACHE-1, CACHE-4: the step contract's own lookup equals BlockManager.can_allocate everywhere."""
    s = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=4,
                                  max_num_batched_tokens=8))
    for prompt in prompts:
        s.add(Sequence(prompt, SamplingParams(max_tokens=2, ignore_eos=True), block_size))
        while s.running or (s.waiting and s.block_manager.can_allocate(s.waiting[0]) != -1):
            try:
                batch, is_prefill = s.schedule()
            except AssertionError:
                break  # an empty decode: the state is still a state worth probing
            s.postprocess(batch, [1] * len(batch), is_prefill)
            candidate = Sequence(probe, SamplingParams(), block_size)
            assert can_allocate(snapshot(s), probe) == s.block_manager.can_allocate(candidate)
    hashes = chain_hashes(probe, block_size)
    expected: list[int] = []
    for i in range(len(probe) // block_size):
        expected.append(reference.compute_hash(probe[i * block_size : (i + 1) * block_size],
                                               expected[-1] if expected else -1))
    assert hashes == expected


# The machine's own invariants catch what the state invariants cannot see.

@pytest.mark.clause("SCHED-3")
def test_a_lost_request_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """SCHED-3: a scheduler that silently drops a request breaks no state invariant, but the machine sees it."""
    original = Scheduler.add

    def add_some(self: Scheduler, seq: Sequence) -> None:
        if len(seq) != 2:  # a prompt of two tokens vanishes
            original(self, seq)

    monkeypatch.setattr(Scheduler, "add", add_some)
    with pytest.raises(StepFailed, match="SCHED-3"):
        run_state_machine_as_test(counting(Machine, Stats()), settings=settings(
            max_examples=50, stateful_step_count=10, derandomize=True, database=None, deadline=None,
            phases=[Phase.generate]))  # finding is the point; shrinking would only cost time


def test_the_machine_counts_what_it_did() -> None:
    """The Stats a runner hands in see examples, rules, steps and requests (the fuzz command prints them)."""
    stats = Stats()
    run_state_machine_as_test(counting(Machine, stats), settings=settings(
        max_examples=10, stateful_step_count=20, derandomize=True, database=None, deadline=None))
    assert stats.examples >= 10 and stats.rule_applications > 0 and stats.steps > 0 and stats.requests > 0
    assert stats.violations == 0

