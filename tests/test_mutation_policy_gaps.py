"""MUT-11: the test gaps the mutation run of the policies found (spec/mutation.md), each closed by a test here.

Each test names the mutant it kills; each was shown failing with its mutant applied and passing without.
"""

from __future__ import annotations

from typing import Any

import pytest

from optimized.core.config import DEFAULT_PATIENCE, SchedulerConfig
from optimized.core.policies import make_scheduler
from optimized.core.port import SchedulerPort
from optimized.verify.reference_port import ReferencePort
from reference.config import SchedulerConfig as ReferenceConfig
from reference.lpm_scheduler import LpmScheduler as ReferenceLpm
from reference.priority_scheduler import PriorityScheduler as ReferencePriority
from reference.sequence import SamplingParams, Sequence


@pytest.mark.clause("MUT-11", "OPT-23", "POLICY-13")
@pytest.mark.parametrize("prefill_too", [False, True], ids=["decode-step", "mixed-step"])
def test_a_mixed_step_is_postprocessed_once(prefill_too: bool) -> None:
    """MUT-11 (optimized/core/mixed_scheduler.py, postprocess's ``not (...)`` dropped): under mixed as under the
    lesson, a batch postprocessed a second time is refused (RuntimeError, nothing changed), a decode-only step's
    and a mixed step's alike; the mutant sent the second call down the mixed fast path, which appended the
    tokens again."""
    config = SchedulerConfig(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, policy="mixed")
    ports: tuple[SchedulerPort[Any], ...] = (make_scheduler(config), ReferencePort(config))
    for port in ports:
        for prompt in ([1, 2, 3], [4, 5]):
            port.add(port.new_sequence(prompt, 10, ignore_eos=True))
        out = port.schedule()
        port.postprocess(out.batch, [7] * len(out.batch), out.is_prefill)
        if prefill_too:
            port.add(port.new_sequence([6, 7, 8, 9], 10, ignore_eos=True))
        out = port.schedule()
        assert out.is_prefill is prefill_too and len(out.batch) == 2 + prefill_too
        port.postprocess(out.batch, [8] * len(out.batch), out.is_prefill)
        before = port.snapshot()
        with pytest.raises(RuntimeError, match="postprocess"):
            port.postprocess(out.batch, [9] * len(out.batch), out.is_prefill)
        assert port.snapshot() == before


@pytest.mark.clause("MUT-11", "POLICY-12")
def test_a_request_added_without_a_priority_has_priority_zero() -> None:
    """MUT-11 (optimized/core/priority_scheduler.py, ``add``'s default ``priority: int = 0`` -> ``1``): POLICY-12's
    default is 0, in the snapshot and in the order: a later arrival of priority 0 queues behind it, one of -1
    ahead of it; as the reference's."""
    config = SchedulerConfig(num_blocks=40, block_size=4, policy="priority")
    ports: tuple[SchedulerPort[Any], ...] = (make_scheduler(config), ReferencePort(config))
    for port in ports:
        plain = port.new_sequence([1, 2], 4)
        port.add(plain)
        same, urgent = port.new_sequence([3, 4], 4), port.new_sequence([5, 6], 4)
        port.add(same, priority=0)
        port.add(urgent, priority=-1)
        state = port.snapshot()
        if port.__class__ is not ReferencePort:
            assert state.priorities == {plain.seq_id: 0, same.seq_id: 0, urgent.seq_id: -1}
        assert [s.seq_id for s in state.waiting] == [urgent.seq_id, plain.seq_id, same.seq_id]


@pytest.mark.clause("MUT-11", "POLICY-11", "POLICY-12")
def test_the_references_defaults_are_the_knobs() -> None:
    """MUT-11 (reference/priority_scheduler.py, ``add``'s ``priority: int = 0`` -> ``1``; reference/lpm_scheduler.py,
    ``DEFAULT_PATIENCE = 8`` -> ``9``): the references used alone default as the knobs do, priority 0 (a later
    arrival of priority 0 queues behind a request added without one) and patience 8 (the config's default)."""
    priority = ReferencePriority(ReferenceConfig(num_blocks=8, block_size=4))
    plain, same = Sequence([1, 2], SamplingParams(max_tokens=4), 4), Sequence([3, 4], SamplingParams(max_tokens=4), 4)
    priority.add(plain)
    priority.add(same, 0)
    assert priority.priority[plain.seq_id] == 0
    assert [s.seq_id for s in priority.waiting] == [plain.seq_id, same.seq_id]
    lpm = ReferenceLpm(ReferenceConfig(num_blocks=8, block_size=4))
    assert lpm.patience == DEFAULT_PATIENCE == SchedulerConfig(num_blocks=8, block_size=4).patience == 8
