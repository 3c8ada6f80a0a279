"""The token arena: regions move without losing tokens or changing decisions (OPT-11)."""


from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import reference
from invariants import snapshot
from optimized.core.scheduler import Scheduler, SchedulerConfig, Sequence
from optimized.core.token_arena import TokenArena
from optimized.engine.sampling_params import SamplingParams
from optimized.verify.conformance import parse_workload


@pytest.mark.clause("OPT-11")
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


@pytest.mark.clause("OPT-6", "OPT-11")
def test_arena_compaction_and_free_queue_trimming_keep_the_decisions() -> None:
    """OPT-6, OPT-11: a tiny arena (compacted again and again) and a long free queue (trimmed) change nothing."""
    reqs = [{"id": i, "prompt": [(i * 7 + k) % 11 for k in range(20 + i % 9)], "max_tokens": 30 + i % 13,
             "ignore_eos": False, "arrive": 0, "output": [1] * 60} for i in range(90)]
    config: dict[str, Any] = {"block_size": 2, "num_blocks": 1100, "max_num_seqs": 16, "max_num_batched_tokens": 96,
                              "eos": 50}
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
