"""The optimized scheduler: the reference's decisions (spec/optimized-scheduler.md, OPT-1..12)."""

from __future__ import annotations

import argparse
import importlib
import json
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

import optimized
import optimized.core.kv_cache_manager as kvm
import reference
from invariants import check_batch, check_state, seq_view, snapshot
from optimized.benchmarks import scheduler as bench
from optimized.conformance import parse_workload, replay
from optimized.core.errors import EmptyDecodeError
from optimized.core.free_queue import FreeBlockQueue
from optimized.core.scheduler import ScheduleOutput, Scheduler, SchedulerConfig, Sequence
from optimized.core.token_arena import TokenArena
from optimized.core.walk_memo import WalkMemo
from optimized.sampling_params import SamplingParams
from optimized.shadow import schedule_reporting_preemptions
from reference.extensions import postprocess_with_stops

SAMPLES = [json.loads(line) for line in
           (Path(optimized.__file__).parent / "data" / "conformance.jsonl").read_text().splitlines() if line.strip()]


def opt_impl() -> ModuleType:
    return importlib.import_module("optimized")


def check_step(scheduler: Any, batch: list[Any], is_prefill: bool) -> None:
    state = snapshot(scheduler)
    found = [*check_batch(state, [seq_view(s) for s in batch], is_prefill),
             *check_state(state, between_steps=False)]
    assert not found, found


def check_between(scheduler: Any, batch: list[Any], is_prefill: bool) -> None:
    found = check_state(snapshot(scheduler))
    assert not found, found


@pytest.mark.parametrize("index", range(len(SAMPLES)))
def test_every_conformance_sample_replays_identically(index: int) -> None:
    """OPT-1: the same trace as the lesson's scheduler, to the last block id; every invariant on every step."""
    sample = SAMPLES[index]
    trace = replay(parse_workload(sample["workload"]), opt_impl(), on_schedule=check_step,
                   on_postprocess=check_between)
    assert trace == sample["trace"]


class Recording(Scheduler):
    """Records the exception schedule() raised, so a test can tell EmptyDecodeError from an assert."""

    raised: list[type[BaseException]]

    def schedule(self) -> ScheduleOutput:
        try:
            return super().schedule()
        except BaseException as e:
            self.raised.append(type(e))
            raise


@pytest.mark.parametrize("index", [i for i, s in enumerate(SAMPLES) if s["trace"][-1].get("error")])
def test_the_empty_decode_raises_EmptyDecodeError_at_the_reference_step(index: int) -> None:
    """OPT-9: where the reference's assert fires, EmptyDecodeError, at the same step, in the same state."""
    raised: list[type[BaseException]] = []

    def make(config: SchedulerConfig) -> Recording:
        s = Recording(config)
        s.raised = raised
        return s

    impl = SimpleNamespace(Scheduler=make, SchedulerConfig=SchedulerConfig, SamplingParams=SamplingParams,
                           Sequence=Sequence)
    trace = replay(parse_workload(SAMPLES[index]["workload"]), impl)  # type: ignore[arg-type]
    assert trace == SAMPLES[index]["trace"]
    assert raised == [EmptyDecodeError]


def twin_run(workload: dict[str, Any], steps: int) -> tuple[reference.Scheduler, Scheduler]:
    """Drive both schedulers with the same requests and tokens; compare batches on the way."""
    w = parse_workload(workload)
    ref, opt = reference.Scheduler(reference.SchedulerConfig(**w.config)), Scheduler(SchedulerConfig(**w.config))
    for r in w.requests:
        ref.add(reference.Sequence(r.prompt, reference.SamplingParams(max_tokens=r.max_tokens,
                                                                      ignore_eos=r.ignore_eos), w.config["block_size"]))
        opt.add(Sequence(r.prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=r.ignore_eos),
                         w.config["block_size"]))
    for _ in range(steps):
        if ref.is_finished():
            break
        (rb, rp), (ob, op) = ref.schedule(), opt.schedule()
        assert rp == op
        assert [(len(s), s.num_scheduled_tokens, s.block_table) for s in rb] == \
               [(len(s), s.num_scheduled_tokens, s.block_table) for s in ob]
        tokens = [1 + (len(s) % 5) for s in rb]
        ref.postprocess(rb, tokens, rp)
        opt.postprocess(ob, tokens, op)
    return ref, opt


def requests(n: int, prompt: int, max_tokens: int, shared: int = 0) -> list[dict[str, Any]]:
    return [{"id": i, "prompt": [9] * shared + [i + 1] * prompt, "max_tokens": max_tokens, "ignore_eos": True,
             "arrive": 0, "output": [1] * max_tokens} for i in range(n)]


def test_the_decode_group_is_the_running_prefix_and_members_read_like_reference_sequences() -> None:
    """OPT-2, OPT-3: members are running[:k]; their counters, read mid-step, are the reference's."""
    workload = {"config": {"block_size": 4, "num_blocks": 64, "max_num_seqs": 3, "max_num_batched_tokens": 64,
                           "eos": 0}, "requests": requests(5, 6, 9)}
    ref, opt = twin_run(workload, 4)
    rb, _ = ref.schedule()
    ob, is_prefill = opt.schedule()
    assert not is_prefill
    assert opt._group.members == opt.running[: len(opt._group.members)] == ob
    fields = ("num_tokens", "num_cached_tokens", "num_scheduled_tokens", "is_prefill", "block_table", "token_ids",
              "num_completion_tokens", "last_token")
    for r, o in zip(rb, ob, strict=True):
        assert [getattr(r, f) for f in fields] == [getattr(o, f) for f in fields]
    assert all(s.num_scheduled_tokens == 1 and not s.is_prefill for s in ob)


def test_decode_without_pressure_never_takes_the_preemption_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """OPT-6: enough free blocks for every member that needs one: no per-sequence can_append loop."""
    def forbidden(self: Scheduler, due: list[Sequence]) -> None:
        raise AssertionError("preemption path taken without pressure")

    monkeypatch.setattr(Scheduler, "_decode_with_preemption", forbidden)
    workload = {"config": {"block_size": 2, "num_blocks": 200, "max_num_seqs": 8, "max_num_batched_tokens": 64,
                           "eos": 0}, "requests": requests(6, 3, 12)}
    ref, opt = twin_run(workload, 100)
    assert ref.is_finished() and opt.is_finished()


def test_preemption_takes_the_newest_and_matches_the_reference() -> None:
    """OPT-7: under pressure the group visits its needy members in order and preempts from the tail."""
    workload = {"config": {"block_size": 2, "num_blocks": 9, "max_num_seqs": 8, "max_num_batched_tokens": 64,
                           "eos": 0}, "requests": requests(4, 3, 8)}
    preempted = 0
    ref, opt = twin_run(workload, 0)
    while not ref.is_finished():
        before = {s.seq_id for s in opt.running}
        (rb, rp), (ob, op) = ref.schedule(), opt.schedule()
        preempted += len(before & {s.seq_id for s in opt.waiting})
        assert [s.block_table for s in rb] == [s.block_table for s in ob]
        assert [len(s) for s in ref.waiting] == [len(s) for s in opt.waiting]
        ref.postprocess(rb, [1] * len(rb), rp)
        opt.postprocess(ob, [1] * len(ob), op)
    assert preempted > 0


@given(st.lists(st.tuples(st.sampled_from(["take", "release", "revive"]), st.integers(0, 7)), max_size=60))
def test_the_free_queue_keeps_the_reference_deque_order(ops: list[tuple[str, int]]) -> None:
    """OPT-4: takes from the front, releases at the back, revivals from anywhere: the deque's order."""
    model: deque[int] = deque(range(8))
    queue = FreeBlockQueue(8)
    for op, n in ops:
        if op == "take":
            m = min(n, len(model))
            assert queue.take(m) == [model.popleft() for _ in range(m)]
        elif op == "release" and n not in model:
            model.append(n)
            queue.append(n)
        elif op == "revive" and n in model:
            model.remove(n)
            queue.remove(n)
        assert list(queue) == list(model)
        assert len(queue) == len(model)
        assert all(queue.contains(b) == (b in model) for b in range(8))


class Computed(list[int]):
    """Hashes ``chain_hashes`` just computed (the test wraps it), as opposed to hashes copied from another chain."""


class RecordedChain(list[int]):
    """A sequence's chain-hash cache that logs, per slot, whether it was hashed or taken from another chain.

    A hash is computed when it is appended one at a time, or extended with ``chain_hashes``'s result.
    """

    def __init__(self, order: int, hashed: list[tuple[int, int]], taken: list[tuple[int, int]]) -> None:
        super().__init__()
        self.order, self.hashed, self.taken = order, hashed, taken

    def append(self, h: int) -> None:
        self.hashed.append((self.order, len(self)))
        super().append(h)

    def extend(self, hs: Iterable[int]) -> None:
        log = self.hashed if isinstance(hs, Computed) else self.taken
        hs = list(hs)
        log.extend((self.order, len(self) + k) for k in range(len(hs)))
        super().extend(hs)


def test_each_full_block_is_hashed_at_most_once_per_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    """OPT-5, OPT-15: prefix hits, preemptions and re-prefills never hash a sequence's block twice.

    Every xxh64 call is counted, and every hash that lands in a sequence's chain cache is logged as
    (request, block index): the calls must equal the logged slots, so no computation goes unattributed.
    """
    calls: list[bytes] = []
    hashed: list[tuple[int, int]] = []
    taken: list[tuple[int, int]] = []
    seqs: list[Sequence] = []
    preempted: list[int] = []
    real_hash, real_add, real_preempt = xxhash.xxh64_intdigest, Scheduler.add, Scheduler._preempt

    def counting(data: bytes) -> int:
        calls.append(data)
        return real_hash(data)

    def add(self: Scheduler, seq: Sequence, stop_token_ids: Iterable[int] = ()) -> None:
        seq.core.hashes = RecordedChain(len(seqs), hashed, taken)
        seqs.append(seq)
        real_add(self, seq, frozenset(stop_token_ids))

    def preempt(self: Scheduler, seq: Sequence) -> None:
        preempted.append(seqs.index(seq))
        real_preempt(self, seq)

    real_chain = kvm.chain_hashes
    monkeypatch.setattr(kvm, "xxh64_intdigest", counting)
    monkeypatch.setattr(kvm, "chain_hashes", lambda prefix, pieces: Computed(real_chain(prefix, pieces)))
    monkeypatch.setattr(Scheduler, "add", add)
    monkeypatch.setattr(Scheduler, "_preempt", preempt)
    block_size, shared, prompt, max_tokens = 2, 4, 5, 10
    workload = {"config": {"block_size": block_size, "num_blocks": 12, "max_num_seqs": 8, "max_num_batched_tokens": 16,
                           "eos": 0}, "requests": requests(4, prompt, max_tokens, shared=shared)}
    ref, opt = twin_run(workload, 400)
    assert ref.is_finished() and opt.is_finished()
    snapshot(opt)  # flushes every pending registration
    assert preempted  # the chains must survive preemptions and re-prefills
    # Each request ends at 9 + 10 tokens; the KV of all but the last was computed, so full blocks 0..8 were each
    # looked up or registered, hence needed once. The 4 shared tokens are blocks 0 and 1, byte-equal across requests.
    full = (shared + prompt + max_tokens - 1) // block_size
    common = shared // block_size
    # Step 1 (16-token budget): request 0's walk hashes its block 0 only (nothing registered yet, so it misses);
    # request 1 is walked beside it (7 tokens left, the walk precedes the chunk check) and takes request 0's only
    # hash. Step 2 applies request 0's registration first; requests 2 and 3, first chained from 1 and from 2, then
    # find both common blocks hashed (OPT-15).
    taken_first = {0: 0, 1: 1, 2: common, 3: common}
    assert sorted(taken) == [(r, i) for r in range(4) for i in range(taken_first[r])]
    assert len(set(hashed)) == len(hashed)
    assert sorted(hashed) == [(r, i) for r in range(4) for i in range(taken_first[r], full)]
    assert len(calls) == len(hashed) == 4 * full - sum(taken_first.values()) == 31
    for seq in seqs:  # and what was taken or hashed is the chain the reference would compute
        tokens, prev, chain = seq.token_ids, -1, []
        for i in range(full):
            piece = np.array(tokens[i * block_size:(i + 1) * block_size], dtype="<i8").tobytes()
            prev = real_hash(piece if prev == -1 else prev.to_bytes(8, "little") + piece)
            chain.append(prev)
        assert list(seq.core.hashes) == chain


def test_registrations_wait_until_the_table_is_read() -> None:
    """OPT-8: a filled block is only logged; a lookup or an inspection applies the log, in order."""
    opt = Scheduler(SchedulerConfig(num_blocks=16, block_size=2, max_num_batched_tokens=64))
    ref = reference.Scheduler(reference.SchedulerConfig(num_blocks=16, block_size=2, max_num_batched_tokens=64))
    opt.add(Sequence([1, 2, 3, 4, 5], SamplingParams(max_tokens=5, ignore_eos=True), 2))
    ref.add(reference.Sequence([1, 2, 3, 4, 5], reference.SamplingParams(max_tokens=5, ignore_eos=True), 2))
    for s in (opt, ref):
        batch, pf = s.schedule()
        s.postprocess(batch, [6], pf)  # type: ignore[arg-type]
    seq = opt.running[0]
    assert opt.block_manager.pending == [kvm.FullBlocks(seq, 0, seq.block_table[:2])]  # a typed entry
    assert opt.block_manager._table == {}
    assert opt.block_manager.hash_to_block_id == ref.block_manager.hash_to_block_id  # reading flushed it
    assert not opt.block_manager.pending


def test_bad_requests_are_refused_at_the_boundary_and_change_nothing() -> None:
    """OPT-10: ValueError naming the field; the scheduler's state is untouched."""
    opt = Scheduler(SchedulerConfig(num_blocks=4, block_size=4))
    before = snapshot(opt)
    with pytest.raises(ValueError, match="block_size"):
        opt.add(Sequence([1, 2], SamplingParams(), 8))
    with pytest.raises(ValueError, match="optimized Sequence"):
        opt.add(reference.Sequence([1, 2], reference.SamplingParams(), 4))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_tokens"):
        opt.add(Sequence([1, 2], reference.SamplingParams(max_tokens=0), 4))
    with pytest.raises(ValueError, match="token_ids"):
        Sequence([1, "x"], SamplingParams(), 4)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="block_size"):
        Sequence([1], SamplingParams(), 1)
    assert snapshot(opt) == before
    seq = Sequence([1, 2], SamplingParams(max_tokens=3), 4)
    opt.add(seq)
    with pytest.raises(ValueError, match="already added"):
        opt.add(seq)
    with pytest.raises(ValueError, match="stop_token_ids"):
        opt.add(Sequence([1, 2], SamplingParams(max_tokens=3), 4), stop_token_ids=[3, True])
    assert len(opt.waiting) == 1 and seq.max_tokens == 3


def test_tokens_survive_arena_moves() -> None:
    """OPT-11: regions move (growth, compaction) without losing tokens."""
    moves: list[int] = []
    arena = TokenArena(on_move=lambda: moves.append(1), capacity=8)
    owners = [SimpleNamespace(region_offset=0, region_capacity=0, n=3, stored_length=lambda: 3) for _ in range(3)]
    for k, owner in enumerate(owners):
        arena.place(owner, np.array([k, k, k], dtype=np.int64), 4)
    assert moves  # the third placement did not fit
    assert arena.release(owners[0]).tolist() == [0, 0, 0]
    arena.place(SimpleNamespace(region_offset=0, region_capacity=0, stored_length=lambda: 0), np.array([], np.int64),
                64)
    for k, owner in enumerate(owners[1:], start=1):
        assert arena.data[owner.region_offset : owner.region_offset + 3].tolist() == [k, k, k]


def test_the_bench_compares_decisions_and_prints_both_sides(capsys: pytest.CaptureFixture[str]) -> None:
    """OPT-12: one run times both schedulers on the same workload and checks they decided the same."""
    w = bench.make_workload("tiny", 6, 16, seed=3, kv_fraction=0.3)
    tokens = list(range(100, 140))
    ref, opt = bench.run(reference, w, tokens), bench.run(optimized, w, tokens)
    assert ref.signature == opt.signature and ref.preemptions == opt.preemptions > 0
    assert bench.main(argparse.Namespace(quick=True, repeat=0, seed=0)) == 2
    out = capsys.readouterr().out
    assert "--repeat" in out


def test_arena_compaction_and_free_queue_trimming_keep_the_decisions() -> None:
    """OPT-4, OPT-11: a tiny arena (compacted again and again) and a long free queue (trimmed) change nothing."""
    reqs = [{"id": i, "prompt": [(i * 7 + k) % 11 for k in range(20 + i % 9)], "max_tokens": 30 + i % 13,
             "ignore_eos": False, "arrive": 0, "output": [1] * 60} for i in range(90)]
    config = {"block_size": 2, "num_blocks": 1100, "max_num_seqs": 16, "max_num_batched_tokens": 96, "eos": 50}
    w = parse_workload({"config": config, "requests": reqs})
    ref, opt = reference.Scheduler(reference.SchedulerConfig(**config)), Scheduler(SchedulerConfig(**config))
    opt._arena = TokenArena(on_move=opt._group.refresh_positions, capacity=64)
    for r in w.requests:
        ref.add(reference.Sequence(r.prompt, reference.SamplingParams(max_tokens=r.max_tokens), 2))
        opt.add(Sequence(r.prompt, SamplingParams(max_tokens=r.max_tokens), 2))
    step = 0
    while not ref.is_finished():
        (rb, rp), (ob, op) = ref.schedule(), opt.schedule()
        assert [(s.num_scheduled_tokens, s.block_table) for s in rb] == [(s.num_scheduled_tokens, s.block_table)
                                                                         for s in ob]
        tokens = [(step * 3 + k) % 7 for k in range(len(rb))]
        ref.postprocess(rb, tokens, rp)
        opt.postprocess(ob, tokens, op)
        step += 1
    assert opt.is_finished()
    r_state, o_state = snapshot(ref), snapshot(opt)
    assert r_state.free_block_ids == o_state.free_block_ids
    assert r_state.hash_to_block_id == o_state.hash_to_block_id
    assert [b.token_ids for b in r_state.blocks] == [b.token_ids for b in o_state.blocks]
    assert opt.block_manager.free._base > 0  # the front of the free list was trimmed at least once


# --- doing less per event (OPT-13..17) ------------------------------------------------------------

class Pair:
    """The reference and the optimized scheduler on one configuration, fed the same requests and tokens."""

    def __init__(self, **config: int) -> None:
        config.setdefault("eos", 0)
        self.block_size = config["block_size"]
        self.ref = reference.Scheduler(reference.SchedulerConfig(**config))
        self.opt = Scheduler(SchedulerConfig(**config))
        self.ref_seqs: list[reference.Sequence] = []
        self.opt_seqs: list[Sequence] = []
        self.outputs: list[ScheduleOutput] = []
        self.stops: dict[int, frozenset[int]] = {}  # reference seq_id -> stop set (OPT-23)

    def add(self, prompt: list[int], max_tokens: int, ignore_eos: bool = True, stops: frozenset[int] = frozenset(),
            ) -> int:
        r = reference.Sequence(prompt, reference.SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                               self.block_size)
        o = Sequence(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), self.block_size)
        self.ref.add(r)
        self.opt.add(o, stops)
        self.stops[r.seq_id] = stops
        self.ref_seqs.append(r)
        self.opt_seqs.append(o)
        return len(self.ref_seqs) - 1

    def step(self, tokens: Any = None, copy_batch: bool = False) -> bool:
        """One schedule()+postprocess() on both; the batches must agree. False once both are idle.

        ``copy_batch``: the optimized scheduler's postprocess gets a copy of its batch (OPT-3).
        """
        if self.ref.is_finished():
            assert self.opt.is_finished()
            return False
        holding = {id(s) for s in self.ref_seqs if s.block_table}
        rb, rp, ref_preempted = schedule_reporting_preemptions(self.ref)
        out = self.opt.schedule()
        self.outputs.append(out)
        ob, op = out.batch, out.is_prefill
        assert rp == op
        assert [self.ref_seqs.index(s) for s in rb] == [self.opt_seqs.index(s) for s in ob]
        assert [(s.num_scheduled_tokens, s.block_table) for s in rb] == \
               [(s.num_scheduled_tokens, s.block_table) for s in ob]
        # OPT-22: what the step reports is what the reference did.
        assert [self.opt_seqs.index(s) for s in out.preempted] == [self.ref_seqs.index(s) for s in ref_preempted]
        admitted = [s.num_cached_tokens for s in rb if id(s) not in holding] if rp else []
        assert out.prefix_hit_tokens == sum(admitted)
        model = [1 + (len(s) * 7) % 5 for s in rb]
        postprocess_with_stops(self.ref, rb, model, rp, [self.stops[s.seq_id] for s in rb])
        self.check_calendar()
        finished = self.opt.postprocess(list(ob) if copy_batch else ob, model if tokens is None else tokens(model), op)
        self.check_calendar()
        assert [self.opt_seqs.index(s) for s in finished] == \
               [self.ref_seqs.index(s) for s in rb if s.status is reference.SequenceStatus.FINISHED]
        return True

    def check_calendar(self) -> None:
        """OPT-3: the finish calendar books every decode-group member exactly once, and has no empty day."""
        group = self.opt._group
        booked = [id(seq) for day in group.finishes.values() for seq in day]
        assert all(group.finishes.values())
        assert sorted(booked) == sorted(id(seq) for seq in group.members)

    def agree(self) -> None:
        """OPT-1: the same queues, sequences and block-manager state; every invariant holds."""
        r, o = snapshot(self.ref), snapshot(self.opt)
        assert check_state(o) == []
        assert (r.free_block_ids, r.used_block_ids, r.hash_to_block_id) == \
               (o.free_block_ids, o.used_block_ids, o.hash_to_block_id)
        assert [(b.ref_count, b.hash, b.token_ids) for b in r.blocks] == \
               [(b.ref_count, b.hash, b.token_ids) for b in o.blocks]
        for attr in ("waiting", "running"):
            assert [self.ref_seqs.index(s) for s in getattr(self.ref, attr)] == \
                   [self.opt_seqs.index(s) for s in getattr(self.opt, attr)]
        for rs, os_ in zip(self.ref_seqs, self.opt_seqs, strict=True):
            assert (rs.status.name, rs.token_ids, rs.num_cached_tokens, rs.num_scheduled_tokens, rs.block_table) == \
                   (os_.status.name, os_.token_ids, os_.num_cached_tokens, os_.num_scheduled_tokens,
                    os_.block_table)


def test_takes_from_never_used_blocks_forget_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """OPT-13: while the free queue's front is in its never-used part, a take touches no hash and no log."""
    def forbidden(self: kvm.KVCacheManager, ids: list[int]) -> None:
        raise AssertionError(f"forgot hashes of never-used blocks {ids}")

    monkeypatch.setattr(kvm.KVCacheManager, "_forget", forbidden)
    p = Pair(block_size=2, num_blocks=400, max_num_seqs=4, max_num_batched_tokens=16)
    for i in range(6):
        p.add([i + 1] * 5, 9)
    while p.step():
        pass
    p.agree()
    assert p.opt.block_manager.free.front <= p.opt.block_manager.pool.clean_end


def test_takes_past_the_never_used_blocks_forget_their_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """OPT-13, OPT-8: once takes reach recycled blocks, their hashes leave the table as the reference's do."""
    forgotten: list[int] = []
    real = kvm.KVCacheManager._forget

    def counting(self: kvm.KVCacheManager, ids: list[int]) -> None:
        forgotten.extend(ids)
        real(self, ids)

    monkeypatch.setattr(kvm.KVCacheManager, "_forget", counting)
    p = Pair(block_size=2, num_blocks=12, max_num_seqs=4, max_num_batched_tokens=16)
    for i in range(6):
        p.add([i + 1] * 5, 6)
    while p.step():
        p.agree()
    assert forgotten


def test_the_remembered_walk_is_always_the_walk_the_reference_would_make() -> None:
    """OPT-14: after every call the memo (cut, freed or dropped as events came) equals a fresh walk."""
    p = Pair(block_size=2, num_blocks=14, max_num_seqs=6, max_num_batched_tokens=12)
    for i in range(8):
        p.add([1, 2, 3, 4] + [i + 5] * (3 + i % 4), 8 + i % 3)
    bm = p.opt.block_manager
    walks = asks = checked = 0
    real_walk, real_ask = bm._walk, bm.can_allocate

    def walk(seq: Sequence) -> WalkMemo:
        nonlocal walks
        walks += 1
        return real_walk(seq)

    def ask(seq: Sequence) -> int:
        nonlocal asks
        asks += 1
        return real_ask(seq)

    bm._walk, bm.can_allocate = walk, ask  # type: ignore[method-assign]
    while p.step():
        bm.flush()
        memo = bm._memo
        if memo is not None:
            kept = (memo.cached, memo.used, memo.hits[: memo.cached])
            fresh = real_walk(memo.seq)
            assert kept == (fresh.cached, fresh.used, fresh.hits)
            checked += 1
        p.agree()
    assert checked and walks < asks  # the head that waited was not walked again on every step


def expected_chain(prompt: list[int], block_size: int) -> list[int]:
    chain, h = [], -1
    for i in range(len(prompt) // block_size):
        h = reference.compute_hash(prompt[i * block_size : (i + 1) * block_size], h)
        chain.append(h)
    return chain


def test_shared_leading_blocks_take_the_last_chain_and_stay_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """OPT-15: equal leading blocks reuse the previous chain's hashes; every chain equals the reference's."""
    a, b, c = [1] * 4, [2] * 4, [3] * 4
    # Shares of one and two blocks, none, and a sequence whose source shares as many blocks as an older,
    # unrelated pair did (the remembered common prefix must not be taken for its own).
    prompts = [[*a, *c, 9], [*a, *b, 9], [*b, *a, 9], [*b, *c, 9], [*a, *c, *b, 9], [*a, *a, *c, *b, 9],
               [*a, *a, *c, 9], [*c, 9]]
    calls: list[bytes] = []
    real = xxhash.xxh64_intdigest

    def counting(data: bytes) -> int:
        calls.append(data)
        return real(data)

    monkeypatch.setattr(kvm, "xxh64_intdigest", counting)
    opt = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=4))
    seqs = [Sequence(prompt, SamplingParams(max_tokens=2), 4) for prompt in prompts]
    for seq in seqs:
        opt.add(seq)
        opt.block_manager.extend_chain(seq, len(seq) // 4)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.core.hashes == expected_chain(prompt, 4)
        assert [bytes(p) for p in seq.core.pieces] == [np.array(prompt[i : i + 4], "<i8").tobytes()
                                                   for i in range(0, len(prompt) - 4, 4)]
    assert len(calls) < sum(len(p) // 4 for p in prompts)


def test_a_logged_decode_fill_lands_after_its_sequence_finished() -> None:
    """OPT-16: fills logged by step are registered from the member's segment even after its table was released."""
    p = Pair(block_size=4, num_blocks=40, max_num_seqs=4, max_num_batched_tokens=64)
    p.add([5, 6, 7], 14)
    p.add([8, 9, 1, 2, 3], 6)
    while p.step():
        pass
    bm = p.opt.block_manager
    assert any(isinstance(entry, kvm.DecodeFills) for entry in bm.pending)  # decode fills waited: nobody read the table
    assert all(not s.block_table for s in p.opt_seqs)
    again = p.add(p.ref_seqs[0].token_ids[:13], 3)  # its blocks 0..2 all filled while decoding
    (rb, rp), (ob, op) = p.ref.schedule(), p.opt.schedule()
    assert rb == [p.ref_seqs[again]] and ob == [p.opt_seqs[again]]
    assert ob[0].num_cached_tokens == rb[0].num_cached_tokens == 12
    assert ob[0].block_table == rb[0].block_table
    p.ref.postprocess(rb, [1], rp)
    p.opt.postprocess(ob, [1], op)
    while p.step():
        pass
    p.agree()


def test_a_preempted_member_segments_resolve_each_fill_to_its_own_table() -> None:
    """OPT-16: a member preempted and rejoined has two segments; fills of both register the right blocks."""
    p = Pair(block_size=2, num_blocks=10, max_num_seqs=4, max_num_batched_tokens=32)
    for i in range(3):
        p.add([i + 1, i + 2, i + 3], 9)
    while p.step():
        p.agree()


def test_model_tokens_as_a_list_or_an_array_decide_the_same() -> None:
    """OPT-17: the struct path (lists) and the numpy path (arrays, tuples) append the same tokens."""
    for convert in (None, lambda t: np.array(t, dtype=np.int64), tuple, lambda t: [*t, 99, 98]):
        p = Pair(block_size=2, num_blocks=60, max_num_seqs=5, max_num_batched_tokens=16)
        for i in range(5):
            p.add([i + 1] * (3 + i), 7 + i, ignore_eos=i % 2 == 0)
        steps = 0
        while p.step(convert):
            steps += 1
            if steps == 6:
                group = p.opt._group
                assert group.now > group.base_clock  # the arena is shifted, positions untouched
        p.agree()


# --- abort (OPT-18..20) ---------------------------------------------------------------------------

def aborted(p: Pair, index: int) -> None:
    from reference.extensions import abort

    abort(p.ref, p.ref_seqs[index])
    p.opt.abort(p.opt_seqs[index])
    p.agree()


def test_abort_a_waiting_sequence_then_run_on() -> None:
    """OPT-18, OPT-19: a waiting request leaves; the rest run as on the reference."""
    p = Pair(block_size=4, num_blocks=30, max_num_seqs=2, max_num_batched_tokens=16)
    for i in range(4):
        p.add([i + 1] * 6, 5)
    p.step()
    aborted(p, 3)
    assert p.opt_seqs[3].status.name == "FINISHED" and p.opt_seqs[3].token_ids == [4] * 6
    while p.step():
        p.agree()


def test_abort_mid_chunk_keeps_the_filled_blocks_for_a_later_hit() -> None:
    """OPT-19: waiting[0] aborted between chunks releases its table in reverse; its filled blocks are hit later."""
    p = Pair(block_size=4, num_blocks=30, max_num_seqs=4, max_num_batched_tokens=6)
    prompt = list(range(1, 15))
    p.add(prompt, 4)
    p.step()
    p.step()
    head = p.opt_seqs[0]
    assert head.status.name == "WAITING" and head.block_table and head.num_cached_tokens == 12
    table = list(head.block_table)
    free_before = p.opt.block_manager.free_block_ids
    aborted(p, 0)
    assert p.opt.block_manager.free_block_ids == [*free_before, *reversed(table)]
    again = p.add(prompt, 3)
    p.step()
    assert p.opt_seqs[again].block_table[:3] == p.ref_seqs[again].block_table[:3] == table[:3]  # three hits
    while p.step():
        p.agree()


@pytest.mark.parametrize("position", [0, 2, 4])
def test_abort_a_decode_group_member_at_any_position(position: int) -> None:
    """OPT-19: a member leaves the group and running at its index; later requests hit its cached blocks."""
    p = Pair(block_size=2, num_blocks=80, max_num_seqs=8, max_num_batched_tokens=64)
    prompts = [[i + 1] * 5 for i in range(5)]
    for prompt in prompts:
        p.add(prompt, 12)
    for _ in range(4):
        p.step()
    group = p.opt._group
    victim = p.opt.running[position]
    assert victim in group.members and group.members == p.opt.running[: len(group.members)]
    held = list(victim.block_table)
    aborted(p, position)
    assert victim not in group.members and group.members == p.opt.running[: len(group.members)]
    later = p.add(p.ref_seqs[position].token_ids, 3)  # 9 tokens: its first 4 blocks are full and cached
    p.step()
    assert p.opt_seqs[later].block_table[:4] == p.ref_seqs[later].block_table[:4] == held[:4]
    while p.step():
        p.agree()


def test_abort_refuses_mid_step_and_strangers_changing_nothing() -> None:
    """OPT-18: RuntimeError between schedule and postprocess; ValueError for a sequence not waiting or running."""
    p = Pair(block_size=4, num_blocks=20, max_num_seqs=4, max_num_batched_tokens=32)
    for i in range(2):
        p.add([i + 1] * 5, 3)
    p.step()
    batch, is_prefill = p.opt.schedule()
    before = snapshot(p.opt)
    with pytest.raises(RuntimeError, match="between steps"):
        p.opt.abort(batch[0])
    assert snapshot(p.opt) == before
    p.opt.postprocess(batch, [1] * len(batch), is_prefill)
    other = Scheduler(SchedulerConfig(num_blocks=4, block_size=4))
    elsewhere = Sequence([1, 2], SamplingParams(), 4)
    other.add(elsewhere)
    before = snapshot(p.opt)
    for stranger in (Sequence([1], SamplingParams(), 4), elsewhere):
        with pytest.raises(ValueError, match="not waiting or running"):
            p.opt.abort(stranger)
    assert snapshot(p.opt) == before and list(other.waiting) == [elsewhere]
    while not p.opt.is_finished():
        b, pf = p.opt.schedule()
        p.opt.postprocess(b, [1] * len(b), pf)
    before = snapshot(p.opt)
    with pytest.raises(ValueError, match="not waiting or running"):
        p.opt.abort(p.opt_seqs[0])
    assert snapshot(p.opt) == before


def test_abort_step_withdraws_a_failed_decode_batch_like_the_reference() -> None:
    """OPT-20: a failed decode step's members are aborted in batch order; the run goes on identically."""
    from reference.extensions import abort_step

    p = Pair(block_size=2, num_blocks=9, max_num_seqs=4, max_num_batched_tokens=32)
    for i in range(3):
        p.add([i + 1] * 3, 6)
    for _ in range(3):
        p.step()
    rb, _ = p.ref.schedule()
    ob, _ = p.opt.schedule()
    with pytest.raises(ValueError, match="exactly the sequences"):
        p.opt.abort_step(ob[:-1])
    abort_step(p.ref, rb)
    p.opt.abort_step(ob)
    p.agree()
    p.add([7, 7, 7], 4)
    while p.step():
        p.agree()


# --- the contracts, used (OPT-21) -----------------------------------------------------------------

def test_the_phase_rule_is_needs_new_block_for_every_member_on_every_step() -> None:
    """OPT-21, OPT-3: the phase the group serves fresh blocks to is exactly block_math.needs_new_block's set."""
    from invariants.block_math import needs_new_block

    p = Pair(block_size=3, num_blocks=200, max_num_seqs=6, max_num_batched_tokens=64)
    for i in range(6):
        p.add([i + 1] * (2 + i), 10 + 2 * i)
    seen = 0
    while not p.opt.is_finished():
        batch, is_prefill = p.opt.schedule()
        group = p.opt._group
        if not is_prefill:
            needy = group.phases[group.needing_blocks(group.now)]
            filling = group.filling(group.now)
            for seq in group.members:
                assert (seq in needy) == needs_new_block(seq.num_tokens, 3)
                assert (seq in filling) == (seq.num_tokens % 3 == 0)
                seen += 1
        p.opt.postprocess(batch, [1] * len(batch), is_prefill)
    assert seen > 50


def test_the_block_math_rules_are_the_ones_the_code_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """OPT-21: replacing prefill_grant, blocks_for or needs_new_block with a wrong rule changes what happens."""
    import optimized.core.scheduler as sched_module
    import optimized.core.sequence as seq_module

    def replay_all() -> list[Any]:
        return [replay(parse_workload(s["workload"]), opt_impl()) for s in SAMPLES[:40]]

    baseline = replay_all()
    with monkeypatch.context() as m:
        m.setattr(sched_module, "prefill_grant", lambda n, r, first: min(n, r))  # chunks every sequence
        assert replay_all() != baseline
    with monkeypatch.context() as m:
        m.setattr(kvm, "blocks_for", lambda n, b: n // b + 1)
        assert replay_all() != baseline
    seq = Sequence([1, 2, 3, 4, 5], SamplingParams(), 4)
    bm = kvm.KVCacheManager(1, 4)
    bm.free.take(1)
    assert not bm.can_append(seq)  # 5 % 4 == 1: a fresh block is needed and none is free
    with monkeypatch.context() as m:
        m.setattr(kvm, "needs_new_block", lambda n, b: False)
        assert bm.can_append(seq)
    with monkeypatch.context() as m:
        m.setattr(seq_module, "blocks_for", lambda n, b: 0)
        assert seq.num_blocks == 0


def test_a_step_reports_whom_it_preempted_what_it_hit_and_whom_it_finished() -> None:
    """OPT-22: ScheduleOutput's preempted and prefix_hit_tokens, and postprocess's finished, are the reference's.

    Pair.step compares them with the reference on every step; this workload makes each of them non-empty.
    """
    p = Pair(block_size=2, num_blocks=9, max_num_seqs=4, max_num_batched_tokens=32)
    p.add([5, 6, 7, 8, 1], 6)
    while p.step() and not p.ref.running:
        pass
    for i in range(3):
        p.add([5, 6, 7, 8, i + 2], 6)
    while p.step():
        pass
    assert any(out.preempted for out in p.outputs)
    assert any(out.prefix_hit_tokens for out in p.outputs)
    batch, is_prefill = p.outputs[0]  # the lesson's pair
    assert (batch, is_prefill) == (p.outputs[0].batch, True)


def test_postprocess_of_an_empty_batch_before_any_schedule_changes_nothing() -> None:
    """OPT-22: as in the reference, postprocess([], [], False) on a fresh scheduler is a no-op (finishes none)."""
    p = Pair(block_size=2, num_blocks=4, max_num_seqs=2, max_num_batched_tokens=8)
    p.add([1, 2, 3], 2)
    p.ref.postprocess([], [], False)
    assert p.opt.postprocess([], [], False) == []
    p.agree()
    while p.step():
        pass


def test_a_hit_freed_before_its_admission_is_no_longer_held_in_the_walk_memo() -> None:
    """OPT-14: a remembered walk whose hit was freed, then cut by a take, counts that hit as free, not held.

    The waiting sequence's walk hits blocks of a running one; that one finishes (the hits go free), and a
    take from the free queue's reused part unmaps a hit (the walk is cut): the memo's count of held hits
    must follow, or the admission test and the chosen blocks differ from the reference's.
    """
    p = Pair(block_size=2, num_blocks=5, max_num_seqs=1, max_num_batched_tokens=16)
    arrivals = [([1], 4, 0), ([1, 3, 1], 3, 1), ([1, 3, 1, 1, 2, 1], 2, 3)]
    steps = 0
    while arrivals or p.step():
        while arrivals and arrivals[0][2] <= steps:
            prompt, max_tokens, _ = arrivals.pop(0)
            p.add(prompt, max_tokens)
        steps += 1
        p.agree()
    assert steps > 3


def test_a_batch_handed_back_as_a_copy_decides_the_same() -> None:
    """OPT-3: postprocess on a copy of the decode batch dissolves the group with each member's grant of one token.

    Every other step hands back a copy; the counters, the hashes and every later decision stay the reference's.
    """
    p = Pair(block_size=2, num_blocks=40, max_num_seqs=4, max_num_batched_tokens=16)
    for i in range(4):
        p.add([i + 1, i + 2, i + 3], 7 + i)
    steps = 0
    while p.step(copy_batch=steps % 2 == 1):
        steps += 1
        p.agree()
    assert steps > 6


def test_a_fill_logged_before_a_member_rejoined_resolves_to_its_earlier_segment() -> None:
    """OPT-16: a decode fill logged in a member's first stay, flushed after it left and rejoined, finds that stay.

    A copy of the batch handed to postprocess makes the members leave the group without a flush, and grow
    one token without the group's clock; the next decode step rejoins them (a new segment) while the earlier
    step's fill is still in the log. After two such steps a later segment's ``length - clock`` is two more
    than the first one's: read from it, the fill would name the wrong block. The flush must walk back from
    the last segment to the one covering the fill's clock.
    """
    p = Pair(block_size=2, num_blocks=40, max_num_seqs=2, max_num_batched_tokens=16)
    p.add([1, 2, 3], 8)
    p.add([4, 5, 6], 8)
    p.step()  # prefill: lengths 4
    p.step()  # decode at clock 0: the members' second blocks fill, logged as one entry for clock 0
    bm = p.opt.block_manager
    assert [entry.clock for entry in bm.pending if isinstance(entry, kvm.DecodeFills)] == [0]
    p.step(copy_batch=True)  # the group dissolves, nothing is flushed
    p.step(copy_batch=True)  # they rejoin at clock 1 (a second segment) and leave again
    p.step()  # they rejoin at clock 1: a third segment
    members = p.opt._group.members
    assert len(members) == 2 and all(len(seq.core.segments) == 3 for seq in members)
    assert all(seq.core.segments[-1][0] == 1 for seq in members)  # the logged clock 0 is in the first segment
    assert all(seq.core.segments[-1][1] == seq.core.segments[0][1] + 2 for seq in members)
    assert [entry.clock for entry in bm.pending if isinstance(entry, kvm.DecodeFills)] == [0]
    p.agree()  # flushes: the fill must register the blocks of the first segment's table
    while p.step():
        p.agree()


@pytest.mark.parametrize(("copy_batch", "unused_stops"), [(False, {9}), (True, {9}), (False, {9, 10, 11, 12})])
def test_a_drawn_stop_token_finishes_its_sequence_beside_eos(copy_batch: bool, unused_stops: set[int]) -> None:
    """OPT-23: the scheduler finishes a sequence that draws one of its stop tokens, in prefill and in decode.

    The reference does through ``postprocess_with_stops``; every decision, the release order included, is the
    same. With ``copy_batch`` the decode steps go through the per-sequence path instead of the group's; with
    more than four stop ids watched in the group, the group looks them up with ``np.isin``.
    """
    p = Pair(block_size=2, num_blocks=40, max_num_seqs=4, max_num_batched_tokens=16)
    # Pair's model token for a sequence of length n is 1 + (7n mod 5): 2 at n = 3, 4 at 4, 1 at 5, 3 at 6.
    p.add([1, 2, 3], 20, stops=frozenset({2}))  # its prefill draws 2: finished at once
    p.add([4, 5, 6, 7], 20, stops=frozenset({3}))  # draws 4, 1, then 3: stops in decode
    p.add([8, 9, 1, 2], 20)  # no stop set: runs to max_tokens
    p.add([3, 4, 5, 6], 20, stops=frozenset({3, *unused_stops}))  # with ids nobody draws
    while p.step(copy_batch=copy_batch):
        p.agree()
    assert [s.num_completion_tokens for s in p.opt_seqs] == [1, 3, 20, 3]
    assert [s.last_token for s in p.opt_seqs] == [2, 3, p.opt_seqs[2].last_token, 3]


def test_no_core_class_writes_another_objects_private_fields_and_sequence_does_not_import_the_group() -> None:
    """OPT-24: the core writes a sequence's state through its ``core`` record only; no ``x._field = ...`` on
    anything but ``self``, and sequence.py imports neither the decode group nor the scheduler."""
    import ast

    core = Path(optimized.__file__).parent / "core"
    writes = []
    for path in sorted(core.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr.startswith("_") and not (
                        isinstance(target.value, ast.Name) and target.value.id == "self"):
                    writes.append(f"{path.name}:{target.lineno} {ast.unparse(target)}")
    assert writes == []
    imported = {node.module for node in ast.walk(ast.parse((core / "sequence.py").read_text()))
                if isinstance(node, ast.ImportFrom)}
    assert not imported & {"optimized.core.decode_group", "optimized.core.scheduler"}


@given(st.lists(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=4, max_size=4), max_size=5))
def test_the_one_chain_hash_is_the_references(blocks: list[list[int]]) -> None:
    """OPT-5: ``chain_hashes``, the only place the optimized scheduler hashes, chains compute_hash."""
    pieces = [np.array(b, dtype="<i8").tobytes() for b in blocks]
    assert kvm.chain_hashes(-1, pieces) == expected_chain([t for b in blocks for t in b], 4)
    source = Path(kvm.__file__).read_text()
    assert source.count("xxh64_intdigest(") == 1 and "def chain_hash(" not in source


def test_an_int64_prompt_is_taken_without_a_second_check_of_each_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """OPT-10: the engine validates a prompt once at its boundary and hands it over as int64; the sequence does not
    check each token again (a list still is checked, and refused with the field named)."""
    import optimized.core.sequence as seq_module

    def forbidden(value: object) -> bool:
        raise AssertionError("a token checked twice")

    monkeypatch.setattr(seq_module, "is_strict_int", forbidden)
    prompt = np.array([5, 6, 7], dtype=np.int64)
    seq = Sequence(prompt, SamplingParams(max_tokens=2), 4)
    prompt[0] = 9  # the sequence holds its own copy
    assert seq.token_ids == [5, 6, 7]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="token_ids"):
        Sequence([5, True], SamplingParams(), 4)
