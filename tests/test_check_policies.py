"""Check mode knows the policy (POLICY-16): the shadow runs the reference of the engine's policy, with each request's
priority and lpm's patience, and finds nothing on a sound run under each policy; a shadow of another policy, or an
engine scheduler that breaks its policy, is reported."""

from __future__ import annotations

from typing import Any

import pytest

from optimized.core.config import POLICIES, SchedulerConfig
from optimized.core.policies import make_scheduler
from optimized.core.port import SchedulerPort
from optimized.verify.reference_port import ReferencePort
from optimized.verify.shadow import Shadow, ShadowDivergence
from reference.priority_scheduler import PriorityScheduler
from reference.sequence import Sequence
from tests.check_driver import config, drive, workload


def urgency(arrival: int) -> int:
    return (arrival * 5) % 4


def policy_config(policy: str) -> SchedulerConfig:
    """A cache tight enough to preempt and a budget that chunks, lpm with a patience that is reached."""
    return config(num_blocks=18, max_num_batched_tokens=8, policy=policy, patience=2)


def engine_port(impl: str, cfg: SchedulerConfig) -> SchedulerPort[Any]:
    """The engine side: the optimized class of the policy, or the policy's reference in its place."""
    return ReferencePort(cfg) if impl == "reference" else make_scheduler(cfg)


def checked_run(port: SchedulerPort[Any], shadow: Shadow, seed: int = 3) -> int:
    priority_of = urgency if port.config.policy == "priority" else None
    return drive(port, shadow, workload(seed, 30), port.config.eos, abort_every=7, priority_of=priority_of)


@pytest.mark.clause("POLICY-16", "CHECK-1", "CHECK-7")
@pytest.mark.parametrize("impl", ["reference", "optimized"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_checked_run_under_each_policy_finds_no_divergence(policy: str, impl: str) -> None:
    """POLICY-16: the shadow built from the engine's config runs that policy's reference (lpm with its patience),
    each request added with its priority; a run with aborts, chunks and preemptions drains without a divergence,
    with whole-state comparisons (the policy's clauses and lpm's counts among them) on the way."""
    cfg = policy_config(policy)
    port = engine_port(impl, cfg)
    shadow = Shadow(cfg, full_every=3)
    assert shadow.reference.snapshot().policy == policy and shadow.config.patience == 2
    checked_run(port, shadow)
    assert port.is_finished() and shadow.full_comparisons >= 5


@pytest.mark.clause("POLICY-16", "CHECK-7")
@pytest.mark.parametrize(("policy", "wrong"), [("priority", "lesson"), ("lpm", "lesson"), ("mixed", "lesson"),
                                               ("lesson", "mixed"), ("lesson", "lpm"), ("priority", "lpm")])
def test_a_shadow_of_another_policy_reports_the_divergence(policy: str, wrong: str) -> None:
    """POLICY-16's negative control: the same run judged by a shadow of the wrong policy diverges (an lpm shadow
    reads passes the engine does not keep from its ``policy_state``: a divergence, not a KeyError)."""
    cfg = policy_config(policy)
    shadow = Shadow(policy_config(wrong), full_every=3)
    with pytest.raises(ShadowDivergence, match=r"check mode, step \d+: "):
        checked_run(ReferencePort(cfg), shadow)


@pytest.mark.clause("POLICY-16", "CHECK-7")
def test_a_shadow_with_another_patience_reports_the_divergence() -> None:
    """POLICY-16: lpm's patience reaches the shadow; a shadow at patience 0 (the lesson's decisions) diverges."""
    with pytest.raises(ShadowDivergence):
        checked_run(ReferencePort(policy_config("lpm")), Shadow(config(num_blocks=18, max_num_batched_tokens=8,
                                                                       policy="lpm", patience=0), full_every=3))


class Unordered(PriorityScheduler):
    """A priority scheduler that queues by arrival."""

    def _insert(self, queue: Any, seq: Sequence) -> None:
        queue.append(seq)


@pytest.mark.clause("POLICY-16", "CHECK-7")
def test_an_engine_scheduler_that_ignores_priorities_is_reported() -> None:
    """POLICY-16: an engine scheduler that drops the priorities the shadow was handed diverges from it."""
    cfg = policy_config("priority")
    with pytest.raises(ShadowDivergence):
        checked_run(ReferencePort(cfg, lesson=Unordered), Shadow(cfg, full_every=3))


@pytest.mark.clause("POLICY-16", "CHECK-7")
def test_lpm_counts_that_differ_are_reported_at_the_full_comparison() -> None:
    """POLICY-16: under lpm the engine's own counts of passes are compared with the reference's at each full
    comparison; an engine count corrupted after a step is reported there, naming them."""
    cfg = policy_config("lpm")
    port = ReferencePort(cfg)
    shadow = Shadow(cfg, full_every=1)

    def corrupt(step: int) -> None:
        lesson = port.lesson_scheduler
        waiting = list(lesson.waiting)
        if step == 6 and waiting:
            lesson.passes[waiting[-1].seq_id] += 1  # type: ignore[attr-defined]

    with pytest.raises(ShadowDivergence, match="lpm passes by arrival"):
        drive(port, shadow, workload(3, 30), cfg.eos, after_postprocess=corrupt)
