"""The optimized scheduler's decisions: replays, what a step reports, stop tokens (OPT-1, OPT-9, OPT-22, OPT-24)."""


from __future__ import annotations

import numpy as np
import pytest

from optimized.core.errors import EmptyDecodeError
from optimized.core.scheduler import ScheduleOutput, Scheduler, SchedulerConfig, Sequence
from optimized.verify.conformance import parse_workload, replay
from tests.optimized_pair import SAMPLES, Pair, check_between, check_step, opt_impl


@pytest.mark.clause("OPT-1")
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

    def schedule(self) -> ScheduleOutput[Sequence]:
        try:
            return super().schedule()
        except BaseException as e:
            self.raised.append(type(e))
            raise


@pytest.mark.clause("OPT-9")
@pytest.mark.parametrize("index", [i for i, s in enumerate(SAMPLES) if s["trace"][-1].get("error")])
def test_the_empty_decode_raises_EmptyDecodeError_at_the_reference_step(index: int) -> None:
    """OPT-9: where the reference's assert fires, EmptyDecodeError, at the same step, in the same state."""
    raised: list[type[BaseException]] = []

    def make(config: SchedulerConfig) -> Recording:
        s = Recording(config)
        s.raised = raised
        return s

    trace = replay(parse_workload(SAMPLES[index]["workload"]), make)
    assert trace == SAMPLES[index]["trace"]
    assert raised == [EmptyDecodeError]


@pytest.mark.clause("OPT-22")
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


@pytest.mark.clause("OPT-22")
def test_postprocess_of_an_empty_batch_before_any_schedule_changes_nothing() -> None:
    """OPT-22: as in the reference, postprocess([], [], False) on a fresh scheduler is a no-op (finishes none)."""
    p = Pair(block_size=2, num_blocks=4, max_num_seqs=2, max_num_batched_tokens=8)
    p.add([1, 2, 3], 2)
    p.ref.postprocess([], [], False)
    assert p.opt.postprocess([], [], False) == []
    p.agree()
    while p.step():
        pass


@pytest.mark.clause("OPT-24")
@pytest.mark.parametrize(("copy_batch", "unused_stops"), [(False, {9}), (True, {9}), (False, {9, 10, 11, 12})])
def test_a_drawn_stop_token_finishes_its_sequence_beside_eos(copy_batch: bool, unused_stops: set[int]) -> None:
    """OPT-24: the scheduler finishes a sequence that draws one of its stop tokens, in prefill and in decode.

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


@pytest.mark.clause("OPT-18")
def test_model_tokens_as_a_list_or_an_array_decide_the_same() -> None:
    """OPT-18: the struct path (lists) and the numpy path (arrays, tuples) append the same tokens."""
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
