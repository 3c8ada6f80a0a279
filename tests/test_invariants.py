"""The invariant predicates: each reports its clause on a corrupted state and nothing on a sound one.

Every state here is a snapshot of the reference scheduler driven through a
small workload that exercises prefix sharing, a freed-but-cached block, a
chunked prefill and a decode step (see ``Scenario``). Each test corrupts one
thing in a fresh snapshot and asserts the clause it breaks is reported; the
replay test runs every conformance sample with all checks at every step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import reference
from invariants import SchedulerState, SeqView, Violation, check_batch, check_state, seq_view, snapshot
from optimized.verify.conformance import implementation, parse_workload, replay

SAMPLES = Path(__file__).resolve().parent.parent / "optimized" / "verify" / "data" / "conformance.jsonl"
BLOCK_SIZE = 4


@dataclass
class Scenario:
    """Snapshots of one reference run, taken at named points.

    Step 0 prefills A (10 tokens) and D (4 tokens, max_tokens 1: it finishes at
    once and leaves its hashed block free but cached). Step 1 prefills B, whose
    first 8 tokens hit A's two full blocks. Step 2 prefills 16 of C's 30 tokens
    (a chunk; C stays at the front of waiting), step 3 the other 14, step 4
    decodes A, B and C.
    """

    after_schedule: dict[int, tuple[SchedulerState, list[int], bool]]
    between_steps: dict[int, SchedulerState]
    idle: SchedulerState


def _run_scenario() -> Scenario:
    config = reference.SchedulerConfig(
        num_blocks=16, block_size=BLOCK_SIZE, max_num_seqs=4, max_num_batched_tokens=16, eos=-1
    )
    scheduler = reference.Scheduler(config)

    def new(prompt: list[int], max_tokens: int) -> reference.Sequence:
        return reference.Sequence(prompt, reference.SamplingParams(max_tokens=max_tokens), BLOCK_SIZE)

    a_prompt = list(range(1, 11))
    arrivals = {
        0: [new(a_prompt, 20), new([40, 41, 42, 43], 1)],
        1: [new([*a_prompt[:8], 20, 21, 22], 20), new(list(range(100, 130)), 20)],
    }
    after: dict[int, tuple[SchedulerState, list[int], bool]] = {}
    between: dict[int, SchedulerState] = {}
    for step in range(5):
        for seq in arrivals.get(step, []):
            scheduler.add(seq)
        seqs, is_prefill = scheduler.schedule()
        after[step] = (snapshot(scheduler), [s.seq_id for s in seqs], is_prefill)
        scheduler.postprocess(seqs, [7] * len(seqs), is_prefill)
        between[step] = snapshot(scheduler)
    while not scheduler.is_finished():
        seqs, is_prefill = scheduler.schedule()
        scheduler.postprocess(seqs, [7] * len(seqs), is_prefill)
    return Scenario(after, between, snapshot(scheduler))


_SCENARIO = _run_scenario()


def between(step: int) -> SchedulerState:
    """A fresh (re-snapshotted) copy of the state after step's postprocess."""
    return _copy(_SCENARIO.between_steps[step])


def scheduled(step: int) -> tuple[SchedulerState, list[SeqView], bool]:
    """A fresh copy of the state right after step's schedule(), with its batch as views of that state."""
    state, ids, is_prefill = _SCENARIO.after_schedule[step]
    state = _copy(state)
    return state, [seq_of(state, i) for i in ids], is_prefill


def _copy(state: SchedulerState) -> SchedulerState:
    return SchedulerState(
        block_size=state.block_size,
        max_num_seqs=state.max_num_seqs,
        max_num_batched_tokens=state.max_num_batched_tokens,
        blocks=[type(b)(b.block_id, b.ref_count, b.hash, list(b.token_ids)) for b in state.blocks],
        free_block_ids=list(state.free_block_ids),
        used_block_ids=set(state.used_block_ids),
        hash_to_block_id=dict(state.hash_to_block_id),
        waiting=[_copy_seq(s) for s in state.waiting],
        running=[_copy_seq(s) for s in state.running],
    )


def _copy_seq(seq: SeqView) -> SeqView:
    return SeqView(**{**seq.__dict__, "token_ids": list(seq.token_ids), "block_table": list(seq.block_table)})


def seq_of(state: SchedulerState, seq_id: int) -> SeqView:
    return next(s for s in [*state.running, *state.waiting] if s.seq_id == seq_id)


def clauses(found: list[Violation]) -> set[str]:
    return {v.clause for v in found}


def state_reports(state: SchedulerState, clause: str, between_steps: bool = True) -> bool:
    found = check_state(state, between_steps=between_steps)
    assert all(isinstance(v, Violation) and v.message for v in found)
    return clause in clauses(found)


def batch_reports(state: SchedulerState, batch: list[SeqView], is_prefill: bool, clause: str) -> bool:
    return clause in clauses(check_batch(state, batch, is_prefill))


# --- the sound states -------------------------------------------------------------------------


@pytest.mark.clause("INV-13", "INV-11", "INV-5")
def test_scenario_reaches_the_shapes_the_corruptions_need() -> None:
    """INV-13, INV-11, INV-5: the scenario really has a chunk, a shared block, a free cached block."""
    _, batch, is_prefill = scheduled(2)
    assert is_prefill and len(batch) == 1 and batch[0].num_scheduled_tokens == 16
    assert between(2).waiting[0].block_table
    shared = [b for b in between(1).blocks if b.ref_count == 2]
    assert shared
    free_cached = [b for b in between(1).blocks if b.ref_count == 0 and b.hash != -1]
    assert free_cached
    assert not scheduled(4)[2]


@pytest.mark.clause(
    "INV-1", "INV-2", "INV-3", "INV-6", "INV-5", "INV-8", "INV-7", "INV-12", "INV-13", "INV-14", "INV-15", "INV-16",
    "INV-18", "INV-19", "INV-4", "INV-17", "INV-9", "INV-20", "INV-10", "INV-11",
)
@pytest.mark.parametrize("step", range(5))
def test_sound_states_report_nothing(step: int) -> None:
    """INV-1..INV-20: every snapshot of the uncorrupted scenario is clean, at both check points."""
    state, batch, is_prefill = scheduled(step)
    assert check_state(state, between_steps=False) == []
    assert check_batch(state, batch, is_prefill) == []
    assert check_state(between(step)) == []
    assert check_state(_copy(_SCENARIO.idle)) == []


# --- state invariants -------------------------------------------------------------------------


@pytest.mark.clause("INV-1")
def test_block_missing_from_both_sets() -> None:
    """INV-1: a block id that is neither free nor used is reported."""
    state = between(1)
    state.free_block_ids.pop()
    assert state_reports(state, "INV-1")


@pytest.mark.clause("INV-1")
def test_block_twice_in_free_queue() -> None:
    """INV-1: a duplicate in the free queue is reported."""
    state = between(1)
    state.free_block_ids.append(state.free_block_ids[0])
    assert state_reports(state, "INV-1")


@pytest.mark.clause("INV-1")
def test_block_both_free_and_used() -> None:
    """INV-1: an id in both the free queue and the used set is reported."""
    state = between(1)
    state.used_block_ids.add(state.free_block_ids[0])
    assert state_reports(state, "INV-1")


@pytest.mark.clause("INV-2")
def test_ref_count_off_by_one_on_shared_block() -> None:
    """INV-2: a shared block whose ref_count forgets one holder is reported."""
    state = between(1)
    shared = next(b for b in state.blocks if b.ref_count == 2)
    shared.ref_count = 1
    assert state_reports(state, "INV-2")


@pytest.mark.clause("INV-2")
def test_free_block_with_nonzero_ref_count() -> None:
    """INV-2: a free block with ref_count 1 is reported."""
    state = between(1)
    state.blocks[state.free_block_ids[0]].ref_count = 1
    assert state_reports(state, "INV-2")


@pytest.mark.clause("INV-2")
def test_sequence_holds_a_free_block() -> None:
    """INV-2: a block table naming a free block is reported."""
    state = between(4)
    state.running[0].block_table[-1] = state.free_block_ids[0]
    assert state_reports(state, "INV-2")


@pytest.mark.clause("INV-3")
def test_leaked_block_at_idle() -> None:
    """INV-3: a used block once every sequence has finished is a leak."""
    state = _copy(_SCENARIO.idle)
    assert not state.waiting and not state.running
    leaked = state.free_block_ids.pop(0)
    state.used_block_ids.add(leaked)
    state.blocks[leaked].ref_count = 1
    assert state_reports(state, "INV-3")


@pytest.mark.clause("INV-6")
def test_running_out_of_arrival_order() -> None:
    """INV-6: two running sequences swapped is reported."""
    state = between(4)
    state.running[0], state.running[1] = state.running[1], state.running[0]
    assert state_reports(state, "INV-6")


@pytest.mark.clause("INV-6")
def test_waiting_before_running_in_arrival_order() -> None:
    """INV-6: a waiting sequence older than a running one (a preempted sequence put at the back) is reported."""
    state = between(1)
    state.waiting[0].seq_id = state.running[0].seq_id + 1
    assert state.waiting[0].seq_id < state.running[-1].seq_id
    assert state_reports(state, "INV-6")


@pytest.mark.clause("INV-5")
def test_prefix_table_points_at_rehashed_block() -> None:
    """INV-5: a mapping h -> b where block b carries another hash is reported."""
    state = between(1)
    h, block_id = next(iter(state.hash_to_block_id.items()))
    state.blocks[block_id].hash = h + 1
    assert state_reports(state, "INV-5")


@pytest.mark.clause("INV-5")
def test_prefix_table_points_at_partial_block() -> None:
    """INV-5: a mapping to a block that is not full is reported."""
    state = between(1)
    partial = state.running[0].block_table[-1]
    state.hash_to_block_id[12345] = partial
    assert state_reports(state, "INV-5")


@pytest.mark.clause("INV-8")
def test_cached_tokens_beyond_sequence() -> None:
    """INV-8: num_cached_tokens larger than num_tokens is reported."""
    state = between(4)
    seq = state.running[0]
    seq.num_cached_tokens = seq.num_tokens + 1
    assert state_reports(state, "INV-8")


@pytest.mark.clause("INV-8")
def test_cached_tokens_without_blocks() -> None:
    """INV-8: a sequence with an empty block table but cached tokens is reported."""
    state = between(1)
    waiting = state.waiting[0]
    assert not waiting.block_table
    waiting.num_cached_tokens = BLOCK_SIZE
    assert state_reports(state, "INV-8")


@pytest.mark.clause("INV-8")
def test_scheduled_tokens_left_after_postprocess() -> None:
    """INV-8: num_scheduled_tokens not reset between steps is reported (and tolerated right after schedule)."""
    state = between(4)
    state.running[0].num_scheduled_tokens = 1
    assert state_reports(state, "INV-8")
    assert not state_reports(state, "INV-8", between_steps=False)


@pytest.mark.clause("INV-7")
def test_running_sequence_marked_waiting() -> None:
    """INV-7: a running sequence whose status is WAITING is reported."""
    state = between(4)
    state.running[1].status = "WAITING"
    assert state_reports(state, "INV-7")


@pytest.mark.clause("INV-7")
def test_sequence_in_both_queues() -> None:
    """INV-7: a sequence both waiting and running is reported."""
    state = between(1)
    state.waiting.append(_copy_seq(state.running[-1]))
    state.waiting[-1].status = "WAITING"
    assert state_reports(state, "INV-7")


@pytest.mark.clause("INV-7")
def test_waiting_sequence_in_decode_mode() -> None:
    """INV-7: a waiting sequence with is_prefill False is reported."""
    state = between(2)
    state.waiting[0].is_prefill = False
    assert state_reports(state, "INV-7")


@pytest.mark.clause("INV-4")
def test_hash_without_full_tokens() -> None:
    """INV-4: a hashed block holding fewer than block_size tokens is reported."""
    state = between(1)
    hashed = next(b for b in state.blocks if b.hash != -1)
    hashed.token_ids.pop()
    assert state_reports(state, "INV-4")


@pytest.mark.clause("INV-4")
def test_tokens_without_hash() -> None:
    """INV-4: an unhashed block that still lists tokens is reported."""
    state = between(1)
    fresh = next(b for b in state.blocks if b.hash == -1)
    fresh.token_ids = [1, 2, 3, 4]
    assert state_reports(state, "INV-4")


@pytest.mark.clause("INV-9")
def test_live_sequence_past_max_tokens() -> None:
    """INV-9: a live sequence holding max_tokens completion tokens should have finished."""
    state = between(4)
    seq = state.running[0]
    seq.max_tokens = seq.num_tokens - seq.num_prompt_tokens
    assert state_reports(state, "INV-9")


@pytest.mark.clause("INV-10")
def test_running_sequence_missing_its_last_block() -> None:
    """INV-10: a running sequence whose block table lacks a block it needs is reported."""
    state = between(4)
    state.running[2].block_table.pop()
    assert state_reports(state, "INV-10")


@pytest.mark.clause("INV-10")
def test_running_sequence_lagging_two_tokens() -> None:
    """INV-10: a running sequence with two uncomputed tokens between steps is reported."""
    state = between(4)
    seq = state.running[0]
    seq.num_cached_tokens -= 1
    assert state_reports(state, "INV-10")


@pytest.mark.clause("INV-11")
def test_blocks_held_behind_the_front_of_waiting() -> None:
    """INV-11: a waiting sequence behind waiting[0] holding blocks is reported."""
    state = between(2)
    newcomer = _copy_seq(state.waiting[0])
    newcomer.seq_id += 1
    newcomer.block_table, newcomer.num_cached_tokens = [], 0
    state.waiting.append(newcomer)
    assert check_state(state) == []
    grabbed = state.free_block_ids.pop(0)
    state.used_block_ids.add(grabbed)
    state.blocks[grabbed].ref_count = 1
    newcomer.block_table.append(grabbed)
    assert state_reports(state, "INV-11")


@pytest.mark.clause("INV-11")
def test_partial_prefill_missing_a_block() -> None:
    """INV-11: a partial prefill in waiting must hold every block of its tokens."""
    state = between(2)
    state.waiting[0].block_table.pop()
    assert state_reports(state, "INV-11")


# --- batch invariants -------------------------------------------------------------------------


@pytest.mark.clause("INV-12")
def test_batch_over_max_num_seqs() -> None:
    """INV-12: more sequences than max_num_seqs is reported."""
    state, batch, is_prefill = scheduled(4)
    state.max_num_seqs = len(batch) - 1
    assert batch_reports(state, batch, is_prefill, "INV-12")


@pytest.mark.clause("INV-12")
def test_prefill_batch_over_token_budget() -> None:
    """INV-12: a prefill batch with more tokens than max_num_batched_tokens is reported."""
    state, batch, is_prefill = scheduled(0)
    assert is_prefill
    state.max_num_batched_tokens = sum(s.num_scheduled_tokens for s in batch) - 1
    assert batch_reports(state, batch, is_prefill, "INV-12")


@pytest.mark.clause("INV-12")
def test_decode_batch_ignores_token_budget() -> None:
    """INV-12: the lesson's decode loop never consults the token budget, so a decode batch may exceed it."""
    state, batch, is_prefill = scheduled(4)
    assert not is_prefill
    state.max_num_batched_tokens = 1
    assert not batch_reports(state, batch, is_prefill, "INV-12")


@pytest.mark.clause("INV-13")
def test_second_sequence_left_unfinished() -> None:
    """INV-13: a partial prefill anywhere but first in the batch is reported."""
    state, batch, is_prefill = scheduled(0)
    assert len(batch) == 2
    batch[1].num_scheduled_tokens -= 1
    assert batch_reports(state, batch, is_prefill, "INV-13")


@pytest.mark.clause("INV-13")
def test_chunk_that_does_not_fill_the_budget() -> None:
    """INV-13: a chunk smaller than the remaining budget is reported (the lesson only chunks at the budget)."""
    state, batch, is_prefill = scheduled(2)
    batch[0].num_scheduled_tokens -= 1
    assert batch_reports(state, batch, is_prefill, "INV-13")


@pytest.mark.clause("INV-13")
def test_chunk_sharing_its_batch() -> None:
    """INV-13: a first-sequence chunk followed by another sequence is reported."""
    state, batch, is_prefill = scheduled(0)
    batch[0].num_scheduled_tokens -= 1
    assert batch_reports(state, batch, is_prefill, "INV-13")


@pytest.mark.clause("INV-14")
def test_decode_of_two_tokens() -> None:
    """INV-14: a decode scheduling two tokens for a sequence is reported."""
    state, batch, is_prefill = scheduled(4)
    batch[1].num_scheduled_tokens = 2
    assert batch_reports(state, batch, is_prefill, "INV-14")


@pytest.mark.clause("INV-15")
def test_zero_length_prefill() -> None:
    """INV-15: a batch sequence with no token to compute is reported."""
    state, batch, is_prefill = scheduled(0)
    batch[1].num_scheduled_tokens = 0
    assert batch_reports(state, batch, is_prefill, "INV-15")


@pytest.mark.clause("INV-15")
def test_tokens_scheduled_outside_the_batch() -> None:
    """INV-15: a sequence outside the batch with scheduled tokens is reported."""
    state, batch, is_prefill = scheduled(2)
    outsider = state.running[0]
    outsider.num_scheduled_tokens = 1
    assert batch_reports(state, batch, is_prefill, "INV-15")


@pytest.mark.clause("INV-16")
def test_write_into_a_shared_block() -> None:
    """INV-16: a sequence writing a block another sequence also holds is reported."""
    state, batch, is_prefill = scheduled(4)
    writer = batch[0]
    target = writer.block_table[writer.num_cached_tokens // BLOCK_SIZE]
    other = batch[2]
    other.block_table.append(target)
    state.blocks[target].ref_count += 1
    assert batch_reports(state, batch, is_prefill, "INV-16")


@pytest.mark.clause("INV-18", "EDGE-2")
def test_empty_decode_of_the_lesson() -> None:
    """INV-18: the lesson's empty decode (EDGE-2) — the only sequence preempts itself — is reported."""
    config = reference.SchedulerConfig(num_blocks=2, block_size=2, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler = reference.Scheduler(config)
    scheduler.add(reference.Sequence([1, 2, 3, 4], reference.SamplingParams(max_tokens=5), 2))
    seqs, is_prefill = scheduler.schedule()
    scheduler.postprocess(seqs, [9], is_prefill)
    with pytest.raises(AssertionError):
        scheduler.schedule()
    state = snapshot(scheduler)
    assert [s.status for s in state.waiting] == ["WAITING"]
    assert clauses(check_batch(state, [], False)) == {"INV-18"}
    assert check_state(state) == []


@pytest.mark.clause("INV-18")
def test_empty_batch_when_idle_is_fine() -> None:
    """INV-18: an empty batch with no work is not a violation."""
    assert check_batch(_copy(_SCENARIO.idle), [], False) == []


@pytest.mark.clause("INV-19")
def test_batch_block_table_too_short() -> None:
    """INV-19: a batch sequence whose block table does not cover its tokens is reported."""
    state, batch, is_prefill = scheduled(3)
    batch[0].block_table.pop()
    assert batch_reports(state, batch, is_prefill, "INV-19")


@pytest.mark.clause("INV-17")
def test_write_into_a_hashed_block() -> None:
    """INV-17: writing a block that already carries a hash (the prefix cache could hand it out) is reported."""
    state, batch, is_prefill = scheduled(4)
    writer = batch[1]
    target = writer.block_table[writer.num_cached_tokens // BLOCK_SIZE]
    state.blocks[target].hash = 42
    assert batch_reports(state, batch, is_prefill, "INV-17")


@pytest.mark.clause("INV-20")
def test_decode_batch_not_at_front_of_running() -> None:
    """INV-20: a decode batch that is not the front of running, in order, is reported."""
    state, batch, is_prefill = scheduled(4)
    assert batch_reports(state, [batch[1], batch[0], batch[2]], is_prefill, "INV-20")


@pytest.mark.clause("INV-20")
def test_finished_prefill_not_at_tail_of_running() -> None:
    """INV-20: a prefill that finished but is not at the tail of running is reported."""
    state, batch, is_prefill = scheduled(1)
    state.running.reverse()
    assert batch_reports(state, batch, is_prefill, "INV-20")


@pytest.mark.clause("INV-20")
def test_decode_sequence_still_in_prefill_mode() -> None:
    """INV-20: a decode batch sequence with is_prefill True is reported."""
    state, batch, is_prefill = scheduled(4)
    batch[0].is_prefill = True
    assert batch_reports(state, batch, is_prefill, "INV-20")


@pytest.mark.clause("INV-20")
def test_sequence_twice_in_batch() -> None:
    """INV-20: a batch naming one sequence twice is reported."""
    state, batch, is_prefill = scheduled(4)
    assert batch_reports(state, [*batch, batch[0]], is_prefill, "INV-20")


# --- the conformance samples ------------------------------------------------------------------


class Recorder:
    """Replay hooks that run every check and remember where each violation appeared."""

    def __init__(self, sample: int) -> None:
        self.sample = sample
        self.step = 0
        self.found: list[tuple[int, int, Violation]] = []

    def on_schedule(self, scheduler: Any, seqs: list[Any], is_prefill: bool) -> None:
        state = snapshot(scheduler)
        views = [seq_view(s) for s in seqs]
        self._keep(check_state(state, between_steps=False) + check_batch(state, views, is_prefill))

    def on_postprocess(self, scheduler: Any, seqs: list[Any], is_prefill: bool) -> None:
        self._keep(check_state(snapshot(scheduler)))
        self.step += 1

    def _keep(self, violations: list[Violation]) -> None:
        self.found.extend((self.sample, self.step, v) for v in violations)


@pytest.mark.clause(
    "INV-1", "INV-2", "INV-3", "INV-6", "INV-5", "INV-8", "INV-7", "INV-12", "INV-13", "INV-14", "INV-15", "INV-16",
    "INV-18", "INV-19", "INV-4", "INV-17", "INV-9", "INV-20", "INV-10", "INV-11",
)
def test_all_conformance_samples_replay_without_violations() -> None:
    """INV-1..INV-20: every state and batch of the 80 reference replays is clean; 3 end in an empty decode."""
    samples = [json.loads(line) for line in SAMPLES.read_text().splitlines() if line.strip()]
    assert len(samples) == 80
    found: list[tuple[int, int, Violation]] = []
    empty_decodes = 0
    for index, sample in enumerate(samples):
        recorder = Recorder(index)
        trace = replay(parse_workload(sample["workload"]), implementation("reference"), recorder.on_schedule,
                       recorder.on_postprocess)
        assert trace == sample["trace"]
        empty_decodes += "error" in trace[-1]
        found.extend(recorder.found)
    assert found == []
    assert empty_decodes == 3
