"""The optimized scheduler: the reference's decisions (spec/optimized-scheduler.md, OPT-1..12)."""

from __future__ import annotations

import argparse
import importlib
import json
from collections import deque
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

import optimized
import optimized.kv_cache_manager as kvm
import reference
from invariants import check_batch, check_state, seq_view, snapshot
from optimized.benchmarks import scheduler as bench
from optimized.conformance import parse_workload, replay
from optimized.errors import EmptyDecodeError
from optimized.free_queue import FreeBlockQueue
from optimized.sampling_params import SamplingParams
from optimized.scheduler import Scheduler, SchedulerConfig, Sequence
from optimized.token_arena import TokenArena

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

    def schedule(self) -> tuple[list[Sequence], bool]:
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


def test_each_full_block_is_hashed_at_most_once_per_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    """OPT-5: prefix hits, preemptions and re-prefills never hash a sequence's block twice."""
    calls: list[bytes] = []
    real = xxhash.xxh64_intdigest
    real_chain = kvm.chain_hash

    def counting(data: bytes) -> int:
        calls.append(data)
        return real(data)

    def counting_chain(contents: bytes, prefix: int) -> int:
        calls.append(contents)
        return real_chain(contents, prefix)

    monkeypatch.setattr(kvm, "xxh64_intdigest", counting)
    monkeypatch.setattr(kvm, "chain_hash", counting_chain)
    workload = {"config": {"block_size": 2, "num_blocks": 12, "max_num_seqs": 8, "max_num_batched_tokens": 16,
                           "eos": 0}, "requests": requests(4, 5, 10, shared=4)}
    ref, opt = twin_run(workload, 400)
    assert ref.is_finished() and opt.is_finished()
    snapshot(opt)  # flushes every pending registration
    full_blocks = sum((5 + 4 + 10 - 1) // 2 for _ in range(4))  # every full block each sequence ever had
    assert 0 < len(calls) <= full_blocks


def test_registrations_wait_until_the_table_is_read() -> None:
    """OPT-8: a filled block is only logged; a lookup or an inspection applies the log, in order."""
    opt = Scheduler(SchedulerConfig(num_blocks=16, block_size=2, max_num_batched_tokens=64))
    ref = reference.Scheduler(reference.SchedulerConfig(num_blocks=16, block_size=2, max_num_batched_tokens=64))
    opt.add(Sequence([1, 2, 3, 4, 5], SamplingParams(max_tokens=5, ignore_eos=True), 2))
    ref.add(reference.Sequence([1, 2, 3, 4, 5], reference.SamplingParams(max_tokens=5, ignore_eos=True), 2))
    for s in (opt, ref):
        batch, pf = s.schedule()
        s.postprocess(batch, [6], pf)  # type: ignore[arg-type]
    assert opt.block_manager.pending and opt.block_manager._table == {}
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
    with pytest.raises(ValueError, match="max_tokens"):
        seq.max_tokens = 0
    assert len(opt.waiting) == 1 and seq.max_tokens == 3


def test_tokens_survive_arena_moves_and_max_tokens_changes_move_the_finish() -> None:
    """OPT-11: regions move (growth, compaction) without losing tokens; a member's finish follows max_tokens."""
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
    # The engine cuts and raises max_tokens between schedule and postprocess: both schedulers agree.
    workload = {"config": {"block_size": 2, "num_blocks": 64, "max_num_seqs": 4, "max_num_batched_tokens": 64,
                           "eos": 0}, "requests": requests(3, 3, 6)}
    ref, opt = twin_run(workload, 3)
    (rb, rp), (ob, op) = ref.schedule(), opt.schedule()
    rb[0].max_tokens, ob[0].max_tokens = 40, 40
    rb[1].max_tokens, ob[1].max_tokens = rb[1].num_completion_tokens + 1, ob[1].num_completion_tokens + 1
    ref.postprocess(rb, [1] * len(rb), rp)
    opt.postprocess(ob, [1] * len(ob), op)
    assert [s.status.name for s in rb] == [s.status.name for s in ob] == ["RUNNING", "FINISHED", "RUNNING"]
    while not ref.is_finished():
        (rb, rp), (ob, op) = ref.schedule(), opt.schedule()
        ref.postprocess(rb, [1] * len(rb), rp)
        opt.postprocess(ob, [1] * len(ob), op)
        assert [(len(s), s.block_table, s.status.name) for s in rb] == [(len(s), s.block_table, s.status.name)
                                                                        for s in ob]
    assert opt.is_finished()


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
