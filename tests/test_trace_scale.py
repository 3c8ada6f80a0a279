"""A GPU run's trace (TRACE-4, TRACE-5, TRACE-9): a header with millions of blocks is read, and a replay or a
drawing costs per step what the live requests hold, not what the cache holds."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator
from importlib import resources
from typing import Any

import pytest

import invariants
import reference.block_manager
from optimized.core.errors import WorkloadError
from optimized.trace import checks
from optimized.trace.replay import replay_trace
from optimized.trace.schema import TraceError, read_trace
from optimized.trace.timeline import build_timeline
from optimized.trace.workload import workload_trace
from optimized.verify.conformance import parse_workload


def header(num_blocks: int) -> str:
    config = {"block_size": 4, "num_blocks": num_blocks, "max_num_seqs": 2, "max_num_batched_tokens": 8, "eos": 0}
    return json.dumps({"version": 1, "config": config})


ADD = json.dumps({"add": {"id": 0, "prompt": [1, 2, 3], "max_tokens": 1, "ignore_eos": False, "arrive": 0}})
STEP = json.dumps({"step": 0, "prefill": True, "batch": [[0, 3, [0]]], "preempted": [], "tokens": [5],
                   "finished": [0]})


def lines(*records: str) -> list[bytes]:
    return [(r + "\n").encode() for r in records]


@pytest.mark.clause("TRACE-4")
def test_a_header_with_millions_of_blocks_replays(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRACE-4: a trace header has its own bounds, not a workload's 2**20 blocks: a GPU run's 2**22 blocks read and
    replay; more than 2**31 blocks (block ids are int32 on the device) is refused by field; a workload file keeps
    its bound. (The one full-state check at the end, seconds over 2**22 blocks, is counted, not run.)"""
    trace = read_trace(lines(header(1 << 22), ADD, STEP))
    assert trace.config["num_blocks"] == 1 << 22
    full: list[Any] = []
    monkeypatch.setattr(checks, "snapshot", lambda scheduler: scheduler)

    def check_state(state: Any, between_steps: bool) -> list[Any]:
        full.append(state)
        return []

    monkeypatch.setattr(checks, "check_state", check_state)
    assert replay_trace(trace, "optimized").ok
    assert len(full) == 1
    assert read_trace(lines(header(1 << 31), ADD, STEP)).config["num_blocks"] == 1 << 31
    with pytest.raises(TraceError, match=r"^line 1: config.num_blocks: must be at most 2147483648, got 2147483649$"):
        read_trace(lines(header((1 << 31) + 1), ADD, STEP))
    with pytest.raises(WorkloadError, match="num_blocks must be <= 1048576"):
        parse_workload({"config": json.loads(header((1 << 20) + 1))["config"], "requests": []})


def long_run(num_blocks: int, steps: int) -> dict[str, Any]:
    """Two requests decoding side by side for ``steps`` steps in a cache of ``num_blocks``."""
    requests = [{"id": i, "prompt": [1 + i, 2, 3], "max_tokens": steps, "ignore_eos": True, "arrive": 0,
                 "output": [7] * steps} for i in range(2)]
    return {"config": {"block_size": 4, "num_blocks": num_blocks, "max_num_seqs": 2, "max_num_batched_tokens": 8,
                       "eos": 0}, "requests": requests}


class CountedDeque(deque[int]):
    """The reference's free queue, counting every walk over it (a scan of the whole cache)."""

    walks = 0

    def __iter__(self) -> Iterator[int]:
        CountedDeque.walks += 1
        return super().__iter__()


@pytest.mark.clause("TRACE-5", "TRACE-9")
def test_a_step_costs_nothing_in_proportion_to_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRACE-5, TRACE-9: over ~100 steps in a 2**18-block cache, the replay (both schedulers) takes a full snapshot
    only every FULL_EVERY steps and at the end, and the timeline never walks the free queue between them."""
    trace = workload_trace(parse_workload(long_run(1 << 18, 100)))
    assert len(trace.steps) == 100
    taken = [0]
    real = invariants.snapshot

    def counted(scheduler: Any) -> Any:
        taken[0] += 1
        return real(scheduler)

    monkeypatch.setattr(checks, "snapshot", counted)
    monkeypatch.setattr(reference.block_manager, "deque", CountedDeque)
    for impl in ("reference", "optimized"):
        taken[0] = 0
        assert replay_trace(trace, impl).ok
        # The 64th step after schedule() and after postprocess, and the end.
        assert taken[0] == 3, (impl, taken[0])
    CountedDeque.walks, taken[0] = 0, 0
    timeline = build_timeline(trace)
    assert len(timeline.frames) == 100 and taken[0] == 3
    assert CountedDeque.walks <= taken[0]  # only the snapshots walk the free queue


@pytest.mark.clause("TRACE-9")
def test_the_kept_counts_are_the_counted_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRACE-9: the free-but-cached count kept without a scan equals a scan of the cache at every step, over the
    figures and the 80 shipped samples (prefix hits, preemption and recompute, the empty decode)."""
    from optimized.trace import timeline as draw
    from optimized.trace.figures import FIGURES

    seen: list[tuple[tuple[int, int, int], tuple[int, int, int]]] = []
    real = draw.CacheCounts.look

    def compared(self: Any, scheduler: Any) -> tuple[int, int, int]:
        kept = real(self, scheduler)
        state = scheduler.snapshot()
        free = state.free_block_ids
        seen.append((kept, (len(state.used_block_ids), len(free), sum(state.blocks[b].hash != -1 for b in free))))
        return kept

    monkeypatch.setattr(draw.CacheCounts, "look", compared)
    for name in FIGURES:
        build_timeline(workload_trace(FIGURES[name].workload()))
    text = resources.files("optimized.verify").joinpath("data/conformance.jsonl").read_text(encoding="utf-8")
    for line in text.splitlines():  # the 80 shipped samples
        if line.strip():
            build_timeline(workload_trace(parse_workload(json.loads(line)["workload"])))
    assert seen and all(kept == counted for kept, counted in seen)
    assert any(counted[2] for _, counted in seen)


def conf3(step: Any) -> dict[str, Any]:
    """A trace's step as CONF-3 writes it (whole block tables)."""
    if step.empty_decode:
        return {"step": step.step, "error": "empty decode"}
    return {"step": step.step, "prefill": step.prefill, "batch": [[i, n, list(t)] for i, n, t in step.batch],
            "preempted": step.preempted, "finished": step.finished}


@pytest.mark.clause("TRACE-8")
def test_a_workloads_trace_is_its_conformance_trace() -> None:
    """TRACE-8: each of the 80 shipped samples, recorded through the reference, holds step records that, with
    their tables rebuilt from version 2's changes, are the sample's conformance trace."""
    text = resources.files("optimized.verify").joinpath("data/conformance.jsonl").read_text(encoding="utf-8")
    samples = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert len(samples) == 80
    for sample in samples:
        trace = workload_trace(parse_workload(sample["workload"]))
        assert [conf3(s) for s in trace.steps] == sample["trace"]
