"""Lesson 03's exercises and statements, run on the reference scheduler.

Each scenario is built through the public API only (add, schedule,
postprocess, and the block manager's queries), exactly as a serving loop would
reach it, then checked against what the lesson says happens.
"""

from __future__ import annotations

import itertools

import pytest

from reference import SamplingParams, Scheduler, Sequence, SequenceStatus
from tests.scheduler_fixtures import make_scheduler

MODEL_TOKEN = 100  # what the "model" answers; never EOS unless a test says so
_fresh = itertools.count(1000)


def request(s: Scheduler, length: int, max_tokens: int = 64, ignore_eos: bool = False) -> Sequence:
    """A prompt of ``length`` distinct tokens (no prefix-cache hit with any other), added to waiting."""
    seq = Sequence([next(_fresh) for _ in range(length)], SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                   s.block_size)
    s.add(seq)
    return seq


def step(s: Scheduler, token: int = MODEL_TOKEN) -> tuple[list[Sequence], bool]:
    batch, is_prefill = s.schedule()
    s.postprocess(batch, [token] * len(batch), is_prefill)
    return batch, is_prefill


def ids(seqs: object) -> list[int]:
    return [s.seq_id for s in seqs]  # type: ignore[attr-defined]


# Exercise A (lesson §7): a decode step by hand.

def exercise_a() -> tuple[Scheduler, Sequence, Sequence, Sequence]:
    """block_size 4, 2 free blocks; A (length 8) and B (length 5) running; C (length 20) waiting."""
    s = make_scheduler(num_blocks=5)
    a, b = request(s, 7), request(s, 4)
    batch, is_prefill = step(s)  # both prompts in one prefill; each gets its first token
    assert is_prefill and batch == [a, b]
    c = request(s, 20)
    assert (len(a), len(b), len(c)) == (8, 5, 20)
    assert len(s.block_manager.free_block_ids) == 2
    assert list(s.running) == [a, b] and list(s.waiting) == [c]
    return s, a, b, c


@pytest.mark.clause("SCHED-1", "SCHED-2", "PREFILL-4", "DECODE-1", "BM-3", "BM-6")
def test_exercise_a_decodes_a_and_b_and_leaves_c_waiting() -> None:
    """Exercise A; SCHED-1, SCHED-2, PREFILL-4, DECODE-1, BM-3, BM-6: the lesson's answer."""
    s, a, b, c = exercise_a()
    assert s.block_manager.can_allocate(c) == -1  # C needs 5 new blocks, 2 are free: break two
    a_table, b_table = list(a.block_table), list(b.block_table)
    assert len(a) % 4 == 0 and s.block_manager.can_append(a)  # A's next token fits its last block
    assert len(b) % 4 == 1  # B's next token opens a block

    batch, is_prefill = s.schedule()

    assert is_prefill is False and batch == [a, b]
    assert [x.num_scheduled_tokens for x in batch] == [1, 1]
    assert a.block_table == a_table  # A needed no new block
    assert b.block_table == [*b_table, 3]  # B took block 3, the front of the free queue
    assert list(s.block_manager.free_block_ids) == [4]
    assert list(s.waiting) == [c] and c.block_table == [] and c.status is SequenceStatus.WAITING  # no preemption
    assert list(s.running) == [a, b]


# Exercise C (lesson §9): three questions about the code.

@pytest.mark.clause("DECODE-2", "DECODE-4", "EDGE-2")
def test_exercise_c1_the_only_running_sequence_preempts_itself() -> None:
    """Exercise C.1; DECODE-2, DECODE-4, EDGE-2: the decode batch is empty and ``assert scheduled_seqs`` fires."""
    s = make_scheduler(num_blocks=1)
    seq = request(s, 4, max_tokens=3)  # ceil((4 + 3 - 1) / 4) = 2 > 1 block: breaks ADMIT-1
    step(s)  # prefill fills the only block; the first token makes the length 5
    assert len(seq) == 5 and not s.block_manager.free_block_ids

    with pytest.raises(AssertionError):
        s.schedule()

    # It preempted itself (else branch skipped by break): back at the head of waiting, no blocks.
    assert list(s.running) == [] and list(s.waiting) == [seq]
    assert seq.status is SequenceStatus.WAITING and seq.is_prefill and seq.block_table == []
    assert list(s.block_manager.free_block_ids) == [0]
    # The lesson hopes the next step prefills it again; it cannot: 5 tokens need 2 blocks of the 1 there is.
    assert s.block_manager.can_allocate(seq) == -1
    with pytest.raises(AssertionError):
        s.schedule()


@pytest.mark.clause("DECODE-2")
def test_exercise_c1_self_preemption_with_a_non_empty_batch_is_no_error() -> None:
    """DECODE-2: a sequence that preempts itself after others were scheduled is simply left out."""
    s = make_scheduler(num_blocks=3)
    a, b = request(s, 4, max_tokens=2), request(s, 4, max_tokens=2)
    step(s)  # one block each, one free; both have length 5, so each needs a new block
    newcomer = request(s, 5)  # needs 2 blocks, 1 is free: the step is a decode step
    batch, is_prefill = s.schedule()
    # a took the last free block; b, alone in running by then, preempted itself and was skipped.
    assert not is_prefill and batch == [a]
    assert list(s.waiting) == [b, newcomer] and b.block_table == [] and list(s.running) == [a]


@pytest.mark.clause("DECODE-2", "PREEMPT-2")
def test_a_sequence_beyond_max_num_seqs_can_be_the_victim() -> None:
    """DECODE-2, PREEMPT-2: the tail is preempted for a visited sequence though max_num_seqs leaves it unscheduled."""
    s = make_scheduler(num_blocks=3, max_num_seqs=1)
    a, b, c = request(s, 4), request(s, 4), request(s, 4)
    for expected in (a, b, c):  # max_num_seqs 1: one prefill per step, each taking one block
        batch, is_prefill = step(s)
        assert is_prefill and batch == [expected]
    assert [len(x) for x in (a, b, c)] == [5, 5, 5] and not s.block_manager.free_block_ids

    batch, is_prefill = s.schedule()  # a needs a block, none is free: c, beyond max_num_seqs, is the victim

    assert not is_prefill and batch == [a]
    assert list(s.waiting) == [c] and c.block_table == [] and c.status is SequenceStatus.WAITING
    assert list(s.running) == [a, b]


@pytest.mark.clause("DECODE-3", "KNOB-1")
def test_exercise_c2_extendleft_reversed_keeps_running_in_fifo_order() -> None:
    """Exercise C.2; DECODE-3, KNOB-1: with max_num_seqs 2 of 3 running, the same oldest two run each step."""
    s = make_scheduler(num_blocks=16, max_num_seqs=2)
    a, b, c = request(s, 3), request(s, 3), request(s, 3)
    step(s)  # prefill a, b (max_num_seqs 2)
    step(s)  # prefill c
    assert list(s.running) == [a, b, c]
    for _ in range(3):
        batch, is_prefill = s.schedule()
        assert not is_prefill and batch == [a, b]
        # extendleft(reversed(batch)) puts the batch back in front, in its order; extend would give [c, a, b].
        assert list(s.running) == [a, b, c]
        s.postprocess(batch, [MODEL_TOKEN] * 2, is_prefill)


@pytest.mark.clause("PREEMPT-1", "PREEMPT-2", "PREEMPT-3")
def test_exercise_c3_a_preempted_sequence_goes_first_in_waiting() -> None:
    """Exercise C.3; PREEMPT-1, PREEMPT-2, PREEMPT-3: the newest is the victim and is prefilled again first."""
    s = make_scheduler(num_blocks=2)
    a = request(s, 4, max_tokens=2)
    b = request(s, 4, max_tokens=2)
    step(s)  # a and b hold one full block each; both have length 5
    d = request(s, 4, max_tokens=1)  # arrives while the cache is full
    tokens_of_b = list(b.token_ids)

    batch, is_prefill = step(s)

    assert not is_prefill and batch == [a]  # a needed a block; b, the newest, was preempted for it
    assert list(s.waiting) == [b, d]  # b jumped ahead of d, which had been waiting longer
    assert b.status is SequenceStatus.WAITING and b.is_prefill and b.block_table == [] and b.num_cached_tokens == 0
    assert b.token_ids == tokens_of_b  # discard and recompute: the KV is gone, the tokens are kept
    assert a.status is SequenceStatus.FINISHED  # a's two tokens are done: its blocks are free again

    batch, is_prefill = s.schedule()
    assert is_prefill and batch == [b] and b.num_scheduled_tokens == len(b) == 5  # recomputed whole, first


# The lesson's statements (§2-§6), one scenario each.

@pytest.mark.clause("SCHED-2", "PREFILL-6")
def test_prefill_first_even_while_sequences_are_running() -> None:
    """SCHED-2, PREFILL-6: a newcomer that fits is prefilled before the running ones decode again."""
    s = make_scheduler(num_blocks=16)
    a = request(s, 3)
    step(s)
    b = request(s, 5)
    batch, is_prefill = step(s)
    assert is_prefill and batch == [b]
    assert list(s.running) == [a, b] and b.status is SequenceStatus.RUNNING


@pytest.mark.clause("PREFILL-2", "PREFILL-3", "PREFILL-5")
def test_break_one_a_spent_budget_ends_the_scan() -> None:
    """PREFILL-2, PREFILL-3, PREFILL-5: with the budget spent, the rest waits though it would fit the cache."""
    s = make_scheduler(num_blocks=16, budget=4)
    a, b, c = request(s, 2), request(s, 2), request(s, 2)
    batch, is_prefill = s.schedule()
    assert is_prefill and batch == [a, b] and [x.num_scheduled_tokens for x in batch] == [2, 2]
    assert list(s.waiting) == [c] and s.block_manager.can_allocate(c) == 0


@pytest.mark.clause("CHUNK-1", "PREFILL-2")
def test_break_three_only_the_first_sequence_is_chunked() -> None:
    """CHUNK-1, PREFILL-2: a second sequence that does not fit the remaining budget is not chunked."""
    s = make_scheduler(num_blocks=16, budget=8)
    a, b = request(s, 6), request(s, 6)
    batch, _ = s.schedule()
    assert batch == [a] and a.num_scheduled_tokens == 6  # b would need 6 of the 2 left: break three
    assert list(s.waiting) == [b] and b.block_table == []
    s.postprocess(batch, [MODEL_TOKEN], True)
    batch, _ = s.schedule()
    assert batch == [b]  # b's prefill is not blocked by a's decode (SCHED-2)


@pytest.mark.clause("CHUNK-1", "CHUNK-2", "POST-1", "POST-2", "KNOB-2")
def test_a_chunked_prefill_runs_in_consecutive_steps_and_discards_its_samples() -> None:
    """CHUNK-1, CHUNK-2, POST-1, POST-2, KNOB-2: 10 tokens at budget 4 take exactly ceil(10/4) = 3 steps."""
    s = make_scheduler(num_blocks=16, budget=4)
    a = request(s, 3)
    step(s)  # a is running: it would decode if the chunked prefill let it
    x = request(s, 10)
    prompt = list(x.token_ids)
    chunks = []
    for _ in range(3):
        batch, is_prefill = s.schedule()
        assert is_prefill and batch == [x]  # a never decodes in between
        assert x.block_table == [1, 2, 3]  # allocated once, at the first chunk
        chunks.append(x.num_scheduled_tokens)
        cached = x.num_cached_tokens
        s.postprocess(batch, [MODEL_TOKEN], is_prefill)
        assert x.num_cached_tokens == cached + chunks[-1] and x.num_scheduled_tokens == 0
        if x.num_cached_tokens < len(prompt):
            assert x.token_ids == prompt and x.status is SequenceStatus.WAITING  # the sample was discarded
    assert chunks == [4, 4, 2]
    assert x.token_ids == [*prompt, MODEL_TOKEN] and x.status is SequenceStatus.RUNNING
    assert list(s.running) == [a, x]


@pytest.mark.clause("EDGE-3", "PREFILL-1", "PREFILL-4")
def test_head_of_line_blocking() -> None:
    """EDGE-3, PREFILL-1, PREFILL-4: a head that cannot get its blocks holds back a short request that could."""
    s = make_scheduler(num_blocks=4)
    a = request(s, 3)
    step(s)  # a holds 1 block, 3 are free
    long, short = request(s, 16), request(s, 2)  # long needs 4 blocks, short needs 1
    assert s.block_manager.can_allocate(long) == -1
    batch, is_prefill = s.schedule()
    assert not is_prefill and batch == [a]
    assert list(s.waiting) == [long, short] and short.block_table == []


@pytest.mark.clause("POST-3")
def test_finishing_on_eos_or_max_tokens_releases_the_blocks() -> None:
    """POST-3: EOS finishes unless ignore_eos; max_tokens always does; a finished sequence frees its blocks."""
    s = make_scheduler(num_blocks=8, eos=7)
    stops, ignores, short = request(s, 3), request(s, 3, ignore_eos=True), request(s, 3, max_tokens=1)
    batch, is_prefill = s.schedule()
    s.postprocess(batch, [7, 7, MODEL_TOKEN], is_prefill)
    assert stops.status is SequenceStatus.FINISHED and short.status is SequenceStatus.FINISHED
    assert ignores.status is SequenceStatus.RUNNING and ignores.token_ids[-1] == 7
    assert list(s.running) == [ignores]
    assert stops.block_table == [] and short.block_table == []
    assert sorted(s.block_manager.used_block_ids) == ignores.block_table


@pytest.mark.clause("KNOB-1", "KNOB-2")
def test_max_num_seqs_bounds_both_loops_and_the_budget_only_prefill() -> None:
    """KNOB-1, KNOB-2: prefill takes max_num_seqs at most; a decode batch may exceed max_num_batched_tokens."""
    s = make_scheduler(num_blocks=16, max_num_seqs=3, budget=2)
    seqs = [request(s, 1) for _ in range(4)]
    prefills = [step(s) for _ in range(2)]
    assert [b for b, _ in prefills] == [seqs[:2], seqs[2:]]  # the 2-token budget admits two 1-token prompts
    batch, is_prefill = s.schedule()
    assert not is_prefill and batch == seqs[:3]  # 3 tokens > budget 2; max_num_seqs 3 caps it
