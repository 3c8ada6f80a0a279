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
