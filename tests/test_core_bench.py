"""The scheduler benchmark: both schedulers timed on one workload, decisions compared (OPT-13)."""


from __future__ import annotations

import argparse

import pytest

import optimized
import reference
from optimized.benchmarks import scheduler as bench


@pytest.mark.clause("OPT-13")
def test_the_bench_compares_decisions_and_prints_both_sides(capsys: pytest.CaptureFixture[str]) -> None:
    """OPT-13: one run times both schedulers on the same workload and checks they decided the same."""
    w = bench.make_workload("tiny", 6, 16, seed=3, kv_fraction=0.3)
    tokens = list(range(100, 140))
    ref, opt = bench.run(reference, w, tokens), bench.run(optimized, w, tokens)
    assert ref.signature == opt.signature and ref.preemptions == opt.preemptions > 0
    with pytest.raises(ValueError, match="--repeat must be in"):
        bench.main(argparse.Namespace(quick=True, repeat=0, seed=0))


@pytest.mark.clause("POLICY-20")
@pytest.mark.parametrize("policy", ["lesson", "mixed", "priority", "lpm"])
def test_the_bench_times_each_policy_against_its_reference(policy: str) -> None:
    """POLICY-20: under each policy the bench drives that policy's reference and its optimized class on the same
    workload, and they decide every step alike (a cache small enough that decodes preempt)."""
    w = bench.make_workload("tiny", 8, 16, seed=5, kv_fraction=0.3)
    tokens = list(range(100, 140))
    ref, opt = bench.run(reference, w, tokens, policy), bench.run(optimized, w, tokens, policy)
    assert ref.signature == opt.signature and ref.preemptions == opt.preemptions


@pytest.mark.clause("POLICY-20")
def test_the_policy_reaches_both_sides() -> None:
    """POLICY-20: the bench really runs the policy asked for, not the lesson's under another name: on the same
    workload the priority reference (its drawn priorities) and the mixed reference each decide otherwise than the
    lesson's, lpm's reference and optimized class otherwise than the lesson on the bench's interleaved system
    prompts, and a policy outside the list is refused."""
    w = bench.make_workload("tiny", 8, 16, seed=5, kv_fraction=0.3)
    tokens = list(range(100, 140))
    lesson = bench.run(reference, w, tokens, "lesson").signature
    assert len(set(w.priorities)) > 1
    for policy in ("priority", "mixed"):
        assert bench.run(reference, w, tokens, policy).signature != lesson
    # lpm reorders only where waiting requests hold different cached prefixes: the interleaved system prompts'
    # workload (on every other one it decides as the lesson, so its ratio there would time the lesson's order).
    interleaved, many = bench.workloads(True, 0)[-1], list(range(100, 612))
    lpm = bench.run(reference, interleaved, many, "lpm").signature
    assert lpm != bench.run(reference, interleaved, many, "lesson").signature
    assert bench.run(optimized, interleaved, many, "lpm").signature == lpm
    with pytest.raises(ValueError, match="--policy must be one of"):
        bench.main(argparse.Namespace(quick=True, repeat=1, seed=0, policy="fifo"))
