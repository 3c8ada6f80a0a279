"""The contracts, used: the scheduler runs invariants.block_math's rules (OPT-26)."""


from __future__ import annotations

from typing import Any

import pytest

import optimized.core.kv_cache_manager as kvm
from optimized.core.scheduler import Sequence
from optimized.engine.sampling_params import SamplingParams
from optimized.verify.conformance import parse_workload, replay
from tests.optimized_pair import SAMPLES, Pair, opt_impl


@pytest.mark.clause("OPT-26", "OPT-3")
def test_the_phase_rule_is_needs_new_block_for_every_member_on_every_step() -> None:
    """OPT-26, OPT-3: the phase the group serves fresh blocks to is exactly block_math.needs_new_block's set."""
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


@pytest.mark.clause("OPT-26")
def test_the_block_math_rules_are_the_ones_the_code_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """OPT-26: replacing prefill_grant, blocks_for or needs_new_block with a wrong rule changes what happens."""
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
