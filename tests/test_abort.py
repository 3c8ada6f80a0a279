"""Abort and the failed step, on the reference (reference.extensions) and the optimized scheduler.

Every scenario runs on both schedulers with the same requests and model
tokens; the reference's state is checked against spec/abort.md directly, and
the optimized scheduler's state must then equal the reference's (ABORT-6),
compared by arrival index since the two number their sequences independently.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

import optimized.core.scheduler as opt
import reference as ref
from invariants import SchedulerState, check_state, snapshot
from optimized.engine.sampling_params import SamplingParams
from optimized.verify.machines.abort_contract import check_abort, check_abort_step
from reference.extensions import abort, abort_step

BS = 4
EOS = 99


def config(num_blocks: int = 16, budget: int = 64, max_num_seqs: int = 8) -> ref.SchedulerConfig:
    return ref.SchedulerConfig(num_blocks=num_blocks, block_size=BS, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=budget, eos=EOS)


class Pair:
    """The reference and the optimized scheduler, fed the same requests and tokens."""

    def __init__(self, cfg: ref.SchedulerConfig) -> None:
        self.ref = ref.Scheduler(cfg)
        self.opt = opt.Scheduler(opt.SchedulerConfig(cfg.num_blocks, cfg.block_size, cfg.max_num_seqs,
                                                     cfg.max_num_batched_tokens, cfg.eos))
        self.ref_seqs: list[ref.Sequence] = []
        self.opt_seqs: list[opt.Sequence] = []

    def add(self, prompt: list[int], max_tokens: int = 8) -> int:
        r = ref.Sequence(prompt, ref.SamplingParams(max_tokens=max_tokens), BS)
        o = opt.Sequence(prompt, SamplingParams(max_tokens=max_tokens), BS)
        self.ref.add(r)
        self.opt.add(o)
        self.ref_seqs.append(r)
        self.opt_seqs.append(o)
        return len(self.ref_seqs) - 1

    def step(self, token: int = 1) -> tuple[list[int], bool]:
        rb, rp = self.ref.schedule()
        ob, op = self.opt.schedule()
        self.ref.postprocess(rb, [token] * len(rb), rp)
        self.opt.postprocess(ob, [token] * len(ob), op)
        return [self.ref_seqs.index(s) for s in rb], rp

    def abort(self, index: int) -> None:
        abort(self.ref, self.ref_seqs[index])
        self.opt.abort(self.opt_seqs[index])

    def states(self) -> tuple[SchedulerState, SchedulerState]:
        return snapshot(self.ref), snapshot(self.opt)

    def assert_agree(self) -> None:
        """ABORT-6: equal states; ABORT-5: every invariant holds on both."""
        r, o = self.states()
        assert fields(r, self.ref_seqs) == fields(o, self.opt_seqs)
        for i, (rs, os) in enumerate(zip(self.ref_seqs, self.opt_seqs, strict=True)):
            assert seq_fields(rs) == seq_fields(os), f"request {i}"
        assert check_state(r) == [] and check_state(o) == []


def seq_fields(seq: Any) -> tuple[Any, ...]:
    return (seq.status.name, list(seq.token_ids), seq.num_cached_tokens, seq.num_scheduled_tokens,
            list(seq.block_table), seq.is_prefill)


def fields(state: SchedulerState, seqs: list[Any]) -> tuple[Any, ...]:
    arrival = {s.seq_id: i for i, s in enumerate(seqs)}
    blocks = [(b.block_id, b.ref_count, b.hash, b.token_ids) for b in state.blocks]
    return (blocks, state.free_block_ids, sorted(state.used_block_ids), sorted(state.hash_to_block_id.items()),
            [arrival[s.seq_id] for s in state.waiting], [arrival[s.seq_id] for s in state.running])


def queues(s: ref.Scheduler, seqs: list[ref.Sequence]) -> tuple[list[int], list[int]]:
    return [seqs.index(x) for x in s.waiting], [seqs.index(x) for x in s.running]


def prompt(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# --- where the sequence stands ------------------------------------------------------------------

@pytest.mark.clause("ABORT-1", "ABORT-2", "ABORT-6")
def test_abort_a_running_sequence_releases_its_blocks_in_reverse_order() -> None:
    """ABORT-1, ABORT-2, ABORT-6: a running sequence leaves running; its blocks go to the free tail, last first."""
    p = Pair(config())
    for start in (10, 30, 50):
        p.add(prompt(start, 9))
    p.step()
    victim = p.ref_seqs[1]
    table = list(victim.block_table)
    free_before = list(p.ref.block_manager.free_block_ids)
    p.abort(1)
    assert queues(p.ref, p.ref_seqs) == ([], [0, 2])
    assert list(p.ref.block_manager.free_block_ids) == [*free_before, *reversed(table)]
    assert victim.status == ref.SequenceStatus.FINISHED and victim.block_table == []
    assert victim.num_cached_tokens == 0 and victim.token_ids[:9] == prompt(30, 9) and len(victim) == 10
    p.assert_agree()
    while not p.ref.is_finished():
        p.step()
        p.assert_agree()


@pytest.mark.clause("ABORT-1")
def test_abort_waiting_sequences_anywhere_in_the_queue() -> None:
    """ABORT-1: the head, the middle and the tail of waiting; the others keep their order."""
    p = Pair(config(budget=4))
    for start in (10, 20, 30, 40):
        p.add(prompt(start, 3))
    p.abort(2)
    assert queues(p.ref, p.ref_seqs) == ([0, 1, 3], [])
    p.abort(0)
    p.abort(3)
    assert queues(p.ref, p.ref_seqs) == ([1], [])
    p.assert_agree()
    assert p.step() == ([1], True)
    p.assert_agree()


@pytest.mark.clause("ABORT-1", "ABORT-5")
def test_abort_a_preempted_sequence() -> None:
    """ABORT-1, ABORT-5: a victim back at the head of waiting, holding nothing, can be aborted."""
    p = Pair(config(num_blocks=2))
    p.add([1, 2, 3, 4], max_tokens=3)
    p.add([5, 6, 7, 8], max_tokens=3)
    p.step()
    p.step()  # 0 opens a block; the cache is full, so 1 is preempted
    assert queues(p.ref, p.ref_seqs) == ([1], [0])
    p.abort(1)
    assert queues(p.ref, p.ref_seqs) == ([], [0])
    p.assert_agree()
    while not p.ref.is_finished():
        p.step()
    p.assert_agree()
    assert snapshot(p.ref).used_block_ids == set()


@pytest.mark.clause("ABORT-1", "ABORT-3", "CHUNK-2")
def test_abort_mid_chunk_keeps_the_finished_chunks_in_the_prefix_cache() -> None:
    """ABORT-1, ABORT-3, CHUNK-2: the head of waiting holding blocks mid-prefill is aborted; the blocks its
    chunks filled stay hashed and a later request with the same prefix hits them; the rest are plain free."""
    p = Pair(config(budget=6))
    long = prompt(10, 14)  # 4 blocks; two chunks of 6 fill blocks 0..2 (positions 0..11), block 3 is half done
    p.add(long)
    p.step()
    p.step()
    head = p.ref.waiting[0]
    assert head is p.ref_seqs[0] and head.num_cached_tokens == 12 and len(head.block_table) == 4
    table = list(head.block_table)
    p.abort(0)
    state = snapshot(p.ref)
    assert [state.blocks[b].hash != -1 for b in table] == [True, True, True, False]
    assert state.used_block_ids == set()
    p.assert_agree()
    # The same prefix again: three full blocks are cached (the third was filled by the second chunk).
    p.add(long)
    assert p.ref.block_manager.can_allocate(p.ref_seqs[1]) == 3
    assert p.step() == ([1], True)
    assert p.ref_seqs[1].block_table[:3] == table[:3]
    p.assert_agree()


@pytest.mark.clause("ABORT-2", "CACHE-5")
def test_abort_a_sharer_keeps_the_shared_block_for_the_other() -> None:
    """ABORT-2, CACHE-5: a block two tables hold drops to one reference and stays used."""
    p = Pair(config())
    p.add(prompt(10, 9))
    p.step()
    p.add(prompt(10, 9))
    p.step()
    a, b = p.ref_seqs
    shared = [x for x in a.block_table if x in b.block_table]
    assert shared and all(p.ref.block_manager.blocks[x].ref_count == 2 for x in shared)
    p.abort(0)
    assert all(p.ref.block_manager.blocks[x].ref_count == 1 for x in shared)
    assert not set(shared) & set(p.ref.block_manager.free_block_ids)
    p.assert_agree()


@pytest.mark.clause("ABORT-5", "INV-3")
def test_aborting_everything_leaves_the_cache_idle() -> None:
    """ABORT-5, INV-3: with every request aborted, no block is used and the cache still hits."""
    p = Pair(config(num_blocks=8, budget=6))
    for start in (10, 10, 30):
        p.add(prompt(start, 9))
    for _ in range(3):
        p.step()
    for i in range(3):
        p.abort(i)
    r, _ = p.states()
    assert r.used_block_ids == set() and r.waiting == [] and r.running == []
    p.assert_agree()
    p.add(prompt(10, 9))
    assert p.ref.block_manager.can_allocate(p.ref_seqs[3]) == 2
    p.step()
    p.assert_agree()


# --- refusals -------------------------------------------------------------------------------------

def refused(p: Pair, act: Callable[[], None], match: str, error: type[Exception] = ValueError) -> None:
    before = p.states()
    with pytest.raises(error, match=match):
        act()
    after = p.states()
    assert fields(before[0], p.ref_seqs) == fields(after[0], p.ref_seqs)
    assert fields(before[1], p.opt_seqs) == fields(after[1], p.opt_seqs)


@pytest.mark.clause("ABORT-4")
def test_refused_aborts_change_nothing() -> None:
    """ABORT-4: never added, finished, aborted twice: ValueError on both, nothing changed."""
    p = Pair(config())
    p.add(prompt(10, 3), max_tokens=1)
    p.add(prompt(20, 3))
    p.add(prompt(30, 3))
    stranger_ref = ref.Sequence([1, 2], ref.SamplingParams(), BS)
    stranger_opt = opt.Sequence([1, 2], SamplingParams(), BS)
    refused(p, lambda: abort(p.ref, stranger_ref), "not waiting or running")
    refused(p, lambda: p.opt.abort(stranger_opt), "not waiting or running")
    p.step()  # request 0 finishes (max_tokens 1)
    assert p.ref_seqs[0].status == ref.SequenceStatus.FINISHED
    refused(p, lambda: abort(p.ref, p.ref_seqs[0]), "not waiting or running")
    refused(p, lambda: p.opt.abort(p.opt_seqs[0]), "not waiting or running")
    p.abort(2)
    refused(p, lambda: abort(p.ref, p.ref_seqs[2]), "not waiting or running")
    refused(p, lambda: p.opt.abort(p.opt_seqs[2]), "not waiting or running")
    p.assert_agree()


@pytest.mark.clause("ABORT-4")
@pytest.mark.parametrize("budget", [5, 64])  # mid-prefill (one waiting, one running); mid-decode
def test_both_refuse_an_abort_mid_step(budget: int) -> None:
    """ABORT-4: between schedule() and postprocess() both refuse with RuntimeError, and nothing changes."""
    p = Pair(config(budget=budget))
    p.add(prompt(10, 5))
    p.add(prompt(20, 5))
    if budget == 64:
        p.step()
    rb, _ = p.ref.schedule()
    ob, _ = p.opt.schedule()
    assert len(rb) == len(ob) >= 1
    for r, o in zip(p.ref_seqs, p.opt_seqs, strict=True):
        refused(p, lambda r=r: abort(p.ref, r), "between steps", RuntimeError)  # type: ignore[misc]
        refused(p, lambda o=o: p.opt.abort(o), "between steps", RuntimeError)  # type: ignore[misc]


# --- the failed step ------------------------------------------------------------------------------

@pytest.mark.clause("FAULT-2")
def test_abort_step_after_a_failed_prefill_registers_nothing() -> None:
    """FAULT-2: the failed prefill's members are aborted in batch order; the blocks it would have filled carry no
    hash, so a later request with the same prompt hits nothing; the request behind the batch is untouched."""
    s = ref.Scheduler(config(budget=10))
    seqs = [ref.Sequence(prompt(start, 5), ref.SamplingParams(), BS) for start in (10, 20, 30)]
    for seq in seqs:
        s.add(seq)
    batch, is_prefill = s.schedule()
    assert is_prefill and batch == seqs[:2]
    tables = [list(x.block_table) for x in batch]
    free_before = list(s.block_manager.free_block_ids)
    abort_step(s, batch)
    assert list(s.block_manager.free_block_ids) == [*free_before, *reversed(tables[0]), *reversed(tables[1])]
    assert all(x.status == ref.SequenceStatus.FINISHED and x.num_scheduled_tokens == 0 for x in batch)
    assert [len(x) for x in batch] == [5, 5]  # no token appended
    state = snapshot(s)
    assert state.hash_to_block_id == {} and check_state(state) == []
    assert list(s.waiting) == [seqs[2]] and not s.running
    again = ref.Sequence(prompt(10, 5), ref.SamplingParams(), BS)
    s.add(again)
    assert s.block_manager.can_allocate(again) == 0


@pytest.mark.clause("FAULT-1", "FAULT-2")
def test_abort_step_after_a_failed_decode_keeps_its_victim_queued() -> None:
    """FAULT-1, FAULT-2: a failed decode step's batch is aborted; the sequence it preempted stays waiting, holding
    nothing, and runs to the end afterwards with no block leaked."""
    s = ref.Scheduler(config(num_blocks=2))
    a = ref.Sequence([1, 2, 3, 4], ref.SamplingParams(max_tokens=3), BS)
    b = ref.Sequence([5, 6, 7, 8], ref.SamplingParams(max_tokens=3), BS)
    s.add(a)
    s.add(b)
    batch, is_prefill = s.schedule()
    s.postprocess(batch, [1, 1], is_prefill)
    batch, is_prefill = s.schedule()  # a opens a block, b is preempted
    assert batch == [a] and not is_prefill and list(s.waiting) == [b]
    abort_step(s, batch)
    assert check_state(snapshot(s)) == [] and a.status == ref.SequenceStatus.FINISHED and len(a) == 5
    while not s.is_finished():
        batch, is_prefill = s.schedule()
        s.postprocess(batch, [1] * len(batch), is_prefill)
        assert check_state(snapshot(s)) == []
    assert b.num_completion_tokens == 3 and snapshot(s).used_block_ids == set()


@pytest.mark.clause("FAULT-2")
def test_abort_step_refuses_a_batch_that_is_not_the_scheduled_one() -> None:
    """FAULT-2: abort_step takes exactly the scheduled batch; anything else is a ValueError changing nothing."""
    s = ref.Scheduler(config(budget=5))
    seqs = [ref.Sequence(prompt(start, 5), ref.SamplingParams(), BS) for start in (10, 20)]
    for seq in seqs:
        s.add(seq)
    batch, _ = s.schedule()
    before = snapshot(s)
    for wrong in ([], seqs, [*batch, *batch]):
        with pytest.raises(ValueError, match="exactly the sequences"):
            abort_step(s, wrong)
        assert snapshot(s) == before


# --- the abort contract bites ---------------------------------------------------------------------

def _aborted_running() -> tuple[SchedulerState, SchedulerState, int]:
    s = ref.Scheduler(config())
    seqs = [ref.Sequence(prompt(10, 9), ref.SamplingParams(), BS) for _ in range(2)]
    seqs.append(ref.Sequence(prompt(40, 6), ref.SamplingParams(), BS))
    for seq in seqs:
        s.add(seq)
    batch, is_prefill = s.schedule()
    s.postprocess(batch, [1] * len(batch), is_prefill)
    before = snapshot(s)
    abort(s, seqs[0])
    return before, snapshot(s), seqs[0].seq_id


@pytest.mark.clause("ABORT-1", "ABORT-2", "ABORT-3")
def test_the_abort_contract_accepts_a_real_abort_and_reports_corruptions() -> None:
    """ABORT-1, ABORT-2, ABORT-3: the machine's abort check is silent on a real abort and names each corruption."""
    before, after, seq_id = _aborted_running()
    assert check_abort(before, after, seq_id) == []

    def clauses(change: Callable[[SchedulerState], None]) -> set[str]:
        bad = copy.deepcopy(after)
        change(bad)
        return {v.clause for v in check_abort(before, bad, seq_id)}

    assert "ABORT-1" in clauses(lambda st: st.running.reverse())
    assert "ABORT-1" in clauses(lambda st: st.waiting.append(before.running[0]))
    assert "ABORT-2" in clauses(lambda st: st.free_block_ids.reverse())
    assert "ABORT-2" in clauses(lambda st: setattr(st.blocks[before.running[0].block_table[0]], "ref_count", 2))

    def unhash(st: SchedulerState) -> None:
        st.blocks[before.running[0].block_table[0]].hash = -1
    assert "ABORT-3" in clauses(unhash)
    assert "ABORT-3" in clauses(lambda st: st.hash_to_block_id.clear())


@pytest.mark.clause("FAULT-2")
def test_the_failed_step_contract_reports_a_registered_block() -> None:
    """FAULT-2: registering what the failed step computed, or keeping a member queued, is reported."""
    s = ref.Scheduler(config())
    seqs = [ref.Sequence(prompt(start, 9), ref.SamplingParams(), BS) for start in (10, 30)]
    for seq in seqs:
        s.add(seq)
    batch, _ = s.schedule()
    scheduled = snapshot(s)
    ids = [x.seq_id for x in batch]
    abort_step(s, batch)
    after = snapshot(s)
    assert check_abort_step(scheduled, after, ids) == []
    hashed = copy.deepcopy(after)
    hashed.blocks[scheduled.running[0].block_table[0]].hash = 5  # as if postprocess had registered it
    assert {v.clause for v in check_abort_step(scheduled, hashed, ids)} == {"FAULT-2"}
    kept = copy.deepcopy(after)
    kept.running = [scheduled.running[1]]
    assert {v.clause for v in check_abort_step(scheduled, kept, ids)} == {"FAULT-2"}
