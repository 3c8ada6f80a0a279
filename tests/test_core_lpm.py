"""POLICY-13, OPT-1: the optimized ``lpm`` policy decides every step as reference/lpm_scheduler.py.

The differential machine runs under the policy (each run draws a patience from 0 to 4) and also compares the
passes; a run is shown to reach overtaking, due requests and preemptions; a variant without the due rule is
caught by the machine. The targeted tests pin the count (the reference's, from the sequences' own chain
hashes, the last block never), the due rule and the partly prefilled front.
"""

from __future__ import annotations

from collections import Counter
from typing import ClassVar

import pytest

import reference
from optimized.core.config import SchedulerConfig
from optimized.core.lpm_scheduler import LpmScheduler
from optimized.verify import conformance
from optimized.verify.machines.differential_machine import Disagreement
from optimized.verify.machines.policy_machines import LpmDifferential
from optimized.verify.reference_port import ReferencePort
from reference.lpm_scheduler import LpmScheduler as ReferenceLpm
from reference.lpm_scheduler import cached_prefix_blocks
from tests.test_core_priority import PolicyMachine, Twin, run_machine


class CountedLpm(PolicyMachine, LpmDifferential):
    reach: ClassVar[Counter[str]] = Counter()


@pytest.mark.clause("POLICY-13", "OPT-1")
class TestLpmDifferential(LpmDifferential.TestCase):  # type: ignore[misc,valid-type]  # hypothesis makes TestCase at run time
    """POLICY-13, OPT-1: the machine under the suite's profile (tests/conftest.py)."""


@pytest.mark.clause("POLICY-13")
def test_the_machine_reaches_overtaking_due_requests_and_preemption() -> None:
    """POLICY-13: a hundred runs of the suite's profile reorder by cached prefix, make requests due and preempt
    (requests come due rarely in its draws: three times in the first fifty runs)."""
    reach = run_machine(CountedLpm, examples=100)
    assert reach["overtaken"] >= 10 and reach["due"] >= 5 and reach["preempted"] >= 5, reach


class NoDueRule(LpmScheduler):
    """Wrong: nobody is ever due; waiting goes by cached blocks alone (the starvation bound is gone)."""

    def _order_waiting(self) -> None:
        patience, self.patience = self.patience, 1 << 62
        try:
            super()._order_waiting()
        finally:
            self.patience = patience


@pytest.mark.clause("POLICY-13", "POLICY-10")
def test_the_machine_catches_the_due_rule_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """POLICY-13, POLICY-10: negative control: without the due rule the machine reports a disagreement."""
    monkeypatch.setitem(conformance.IMPLEMENTATIONS, "optimized", NoDueRule)
    with pytest.raises(Disagreement):
        run_machine(CountedLpm)


# --- targeted ---------------------------------------------------------------------------------------------------
def counts(t: Twin) -> tuple[list[int], list[int]]:
    """Every waiting request's cached leading blocks: the reference's function on its state, and ours."""
    ref = t.ref.lesson_scheduler
    assert isinstance(ref, ReferenceLpm) and isinstance(t.opt, LpmScheduler)
    return ([cached_prefix_blocks(ref.block_manager, s) for s in ref.waiting],
            [t.opt.block_manager.cached_prefix_blocks(s) for s in t.opt.waiting])


@pytest.mark.clause("POLICY-8", "POLICY-13")
def test_the_count_is_the_references_and_never_the_last_block() -> None:
    """POLICY-8: counted as can_allocate counts, the last block never: a prompt of three full cached blocks counts
    2, one sharing two blocks 2, one sharing one 1, an unrelated one 0; the most cached goes first."""
    t = Twin("lpm", max_num_seqs=1, patience=8)
    t.add("base", [1, 2, 3, 4, 5, 6], max_tokens=30)
    t.step()  # base's three blocks enter the prefix cache
    t.add("cold", [9, 9, 9])
    t.add("one", [1, 2, 7, 7, 7])
    t.add("same", [1, 2, 3, 4, 5, 6])
    t.add("two", [1, 2, 3, 4, 8])
    assert counts(t) == ([0, 1, 2, 2], [0, 1, 2, 2])
    assert t.step() == (["same"], True)
    assert t.queues(t.opt)[0] == ["two", "one", "cold"]
    assert counts(t) == ([2, 1, 0], [2, 1, 0])


@pytest.mark.clause("POLICY-10", "POLICY-13")
def test_a_request_passed_over_patience_times_goes_first() -> None:
    """POLICY-10: a request with nothing cached is passed over by later arrivals that hit the cache, twice at
    patience 2; then it is due and goes before them."""
    t = Twin("lpm", max_num_seqs=1, patience=2)
    t.add("base", [1, 2, 3, 4, 5], max_tokens=30)
    t.step()
    t.add("cold", [9, 9, 9, 9, 9])
    t.add("warm1", [1, 2, 3, 4, 6])
    assert t.step() == (["warm1"], True)
    t.add("warm2", [1, 2, 3, 4, 7])
    assert t.step() == (["warm2"], True)
    assert t.opt.snapshot().passes == {t.opt.waiting[0].seq_id: 2}
    t.add("warm3", [1, 2, 3, 4, 8])
    assert t.step() == (["cold"], True)
    assert t.step() == (["warm3"], True)


@pytest.mark.clause("POLICY-8", "POLICY-13")
def test_a_prefill_cut_short_keeps_the_front() -> None:
    """POLICY-8: a chunked prompt holds waiting[0] though a request with more cached blocks arrives."""
    t = Twin("lpm", max_num_batched_tokens=4, patience=8)
    t.add("base", [1, 2, 3, 4, 5, 6], max_tokens=30)
    t.step()
    t.step()
    t.add("long", [9] * 10)
    assert t.step() == (["long"], True)
    t.add("warm", [1, 2, 3, 4, 5, 6, 7])
    assert counts(t) == ([2, 3], [2, 3])  # its own first chunk is cached: 2, fewer than 3
    assert t.step() == (["long"], True)
    assert t.queues(t.opt)[0] == ["long", "warm"]


@pytest.mark.clause("POLICY-13")
def test_the_snapshot_names_the_policy_its_patience_and_the_waiting_passes() -> None:
    """POLICY-13: ``passes`` maps each waiting request to the times it was passed over; ``patience`` is the
    config's."""
    scheduler = LpmScheduler(SchedulerConfig(num_blocks=8, block_size=2, max_num_seqs=1, policy="lpm", patience=3))
    first, second = scheduler.new_sequence([1, 2], 4), scheduler.new_sequence([3, 4], 4)
    scheduler.add(first)
    scheduler.add(second)
    state = scheduler.snapshot()
    assert (state.policy, state.patience, state.passes) == ("lpm", 3, {first.seq_id: 0, second.seq_id: 0})
    out = scheduler.schedule()
    scheduler.postprocess(out.batch, [5], True)
    assert scheduler.snapshot().passes == {second.seq_id: 0}  # running: not reported, not passed over (earlier)


@pytest.mark.clause("POLICY-13")
def test_the_reference_adapter_and_ours_agree_on_the_patience() -> None:
    """POLICY-13: both read the config's patience."""
    config = SchedulerConfig(num_blocks=4, block_size=2, policy="lpm", patience=5)
    ref = ReferencePort(config).lesson_scheduler
    assert isinstance(ref, reference.Scheduler) and isinstance(ref, ReferenceLpm) and ref.patience == 5
    assert LpmScheduler(config).patience == 5


@pytest.mark.clause("POLICY-8", "POLICY-13")
def test_the_count_stops_where_a_hash_hit_holds_other_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """POLICY-8: with a chain hash of five values (both sides), a hash hit over other tokens is everywhere; the
    count still ends where the reference's ends (at the first block whose stored tokens differ), and the
    decisions stay the reference's."""
    import random

    import xxhash

    import optimized.core.kv_cache_manager as kvm
    import reference.block_manager as rbm
    import reference.lpm_scheduler as rlpm

    real_reference, real_optimized = rbm.compute_hash, xxhash.xxh64_intdigest
    for module in (rbm, rlpm):
        monkeypatch.setattr(module, "compute_hash", lambda token_ids, prefix=-1: real_reference(token_ids, prefix) % 5)
    monkeypatch.setattr(kvm, "xxh64_intdigest", lambda data: real_optimized(data) % 5)
    compared = collided = 0
    for seed in range(30):
        rng = random.Random(seed)
        t = Twin("lpm", num_blocks=24, max_num_seqs=rng.randint(1, 3), max_num_batched_tokens=rng.choice([4, 8]),
                 patience=rng.randint(1, 4))
        for i in range(rng.randint(3, 7)):
            t.add(f"r{i}", [rng.randint(1, 3) for _ in range(rng.randint(3, 9))], max_tokens=rng.randint(1, 4))
        while not t.ref.is_finished():
            ref_counts, opt_counts = counts(t)
            assert ref_counts == opt_counts
            assert isinstance(t.opt, LpmScheduler)
            table = t.opt.block_manager.hash_to_block_id
            for seq, count in zip(t.opt.waiting, opt_counts, strict=True):
                leading = 0
                while leading < seq.num_blocks - 1 and t.opt.block_manager.chain_hash_of(seq, leading) in table:
                    leading += 1
                collided += leading > count
            compared += len(opt_counts)
            t.step()
    assert compared > 100 and collided > 10, (compared, collided)
