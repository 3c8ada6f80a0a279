"""The 80 shipped conformance samples replay identically on the reference, every step checked.

Each sample is replayed through the normative loop (optimized/verify/conformance.py),
driving through the reference's port adapter a lesson scheduler that snapshots
itself around schedule() and postprocess(), so
the state invariants, the batch invariants and the step contract are all
checked at every step. Two mutants show the traces pin the lesson's decisions:
a LIFO free queue and an oldest-first victim both change some trace.
"""

from __future__ import annotations

import json
from collections import deque
from functools import partial
from importlib import resources
from typing import Any

import pytest

import reference
from invariants import SchedulerState, SeqView, Violation, check_batch, check_state, seq_view, snapshot
from optimized.core.port import PortFactory
from optimized.verify.conformance import parse_workload, replay
from optimized.verify.machines.step_contract import check_postprocess, check_schedule
from optimized.verify.reference_port import ReferencePort
from reference import Sequence


def shipped() -> list[dict[str, Any]]:
    text = resources.files("optimized.verify").joinpath("data/conformance.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


SAMPLES = shipped()


class CheckedScheduler(reference.Scheduler):
    """The reference, recording every violation of every clause around each call."""

    def __init__(self, config: reference.SchedulerConfig) -> None:
        super().__init__(config)
        self.violations: list[Violation] = []
        self.before: SchedulerState | None = None
        self.scheduled: SchedulerState | None = None
        self.batch: list[SeqView] = []
        self.ignore_eos: dict[int, bool] = {}

    def schedule(self) -> tuple[list[Sequence], bool]:
        self.before = snapshot(self)
        self.ignore_eos.update({s.seq_id: s.ignore_eos for s in (*self.waiting, *self.running)})
        batch, is_prefill = super().schedule()
        self.scheduled = snapshot(self)
        self.batch = [seq_view(s) for s in batch]
        self.violations += check_state(self.scheduled, between_steps=False)
        self.violations += check_batch(self.scheduled, self.batch, is_prefill)
        self.violations += check_schedule(self.before, self.scheduled, self.batch, is_prefill)
        return batch, is_prefill

    def postprocess(self, seqs: list[Sequence], token_ids: list[int], is_prefill: bool) -> None:
        super().postprocess(seqs, token_ids, is_prefill)
        after = snapshot(self)
        assert self.scheduled is not None
        self.violations += check_state(after)
        self.violations += check_postprocess(self.scheduled, after, self.batch, list(token_ids), is_prefill,
                                             self.eos, self.ignore_eos)


def impl_with(scheduler: type[reference.Scheduler]) -> PortFactory:
    """The reference's port with another lesson Scheduler class, for the replay loop."""
    return partial(ReferencePort, lesson=scheduler)


def replay_checked(sample: dict[str, Any]) -> tuple[list[dict[str, Any]], list[Violation]]:
    schedulers: list[CheckedScheduler] = []

    class Recorded(CheckedScheduler):
        def __init__(self, config: reference.SchedulerConfig) -> None:
            super().__init__(config)
            schedulers.append(self)

    trace = replay(parse_workload(sample["workload"]), impl_with(Recorded))
    return trace, schedulers[0].violations


@pytest.mark.clause("CONF-2", "CONF-3", "CONF-4", "CONF-5", "KNOB-1", "KNOB-3")
@pytest.mark.parametrize("index", range(len(SAMPLES)))
def test_sample_replays_identically_with_every_clause_checked(index: int) -> None:
    """CONF-2, CONF-3, CONF-4, CONF-5, KNOB-1, KNOB-3: identical trace, no violation, batches within the knobs."""
    sample = SAMPLES[index]
    trace, violations = replay_checked(sample)
    assert trace == sample["trace"]
    assert violations == []
    config = sample["workload"]["config"]
    for record in trace:
        if "error" in record:
            continue
        assert 1 <= len(record["batch"]) <= config["max_num_seqs"]
        assert all(0 <= b < config["num_blocks"] for _, _, table in record["batch"] for b in table)


@pytest.mark.clause("CONF-4", "EDGE-2", "ADMIT-2", "ADMIT-1")
def test_the_samples_are_as_described() -> None:
    """CONF-4, EDGE-2, ADMIT-2: 80 samples; the 3 that end in the empty decode are the 3 that break ADMIT-1."""
    assert len(SAMPLES) == 80

    def admitted(sample: dict[str, Any]) -> bool:
        c = sample["workload"]["config"]
        return all(-(-(len(r["prompt"]) + r["max_tokens"] - 1) // c["block_size"]) <= c["num_blocks"]
                   for r in sample["workload"]["requests"])

    breaking = [i for i, s in enumerate(SAMPLES) if not admitted(s)]
    empty = [i for i, s in enumerate(SAMPLES) if s["trace"][-1].get("error") == "empty decode"]
    assert breaking == empty == [62, 64, 66]


class LifoFreeQueue(reference.Scheduler):
    """Released blocks go to the front of the free queue instead of the back."""

    def __init__(self, config: reference.SchedulerConfig) -> None:
        super().__init__(config)
        bm = self.block_manager

        class Lifo(deque[int]):
            def append(self, x: int) -> None:
                self.appendleft(x)

        bm.free_block_ids = Lifo(bm.free_block_ids)


class OldestVictim(reference.Scheduler):
    """Preempts the oldest other running sequence instead of the newest."""

    def preempt(self, seq: Sequence) -> None:
        if self.running:  # seq is a victim popped from the tail: sacrifice the head instead
            self.running.append(seq)
            seq = self.running.popleft()
        super().preempt(seq)


def differing(scheduler: type[reference.Scheduler]) -> int:
    impl = impl_with(scheduler)
    count = 0
    for sample in SAMPLES:
        count += replay(parse_workload(sample["workload"]), impl) != sample["trace"]
    return count


@pytest.mark.clause("BM-2")
def test_the_traces_pin_the_free_queue_order() -> None:
    """BM-2: a LIFO free queue hands out other block ids, and the traces see it."""
    assert differing(LifoFreeQueue) > 0


@pytest.mark.clause("PREEMPT-2")
def test_the_traces_pin_the_victim() -> None:
    """PREEMPT-2: preempting the oldest instead of the newest changes some trace."""
    assert differing(OldestVictim) > 0
