"""The decode group: the running prefix, its clock, phases and calendar (OPT-2, OPT-3, OPT-4, OPT-5)."""


from __future__ import annotations

import pytest

from optimized.core.scheduler import Scheduler, Sequence
from tests.optimized_pair import Pair, requests, twin_run


@pytest.mark.clause("OPT-2", "OPT-3")
def test_the_decode_group_is_the_running_prefix_and_members_read_like_reference_sequences() -> None:
    """OPT-2, OPT-3: members are running[:k]; their counters, read mid-step, are the reference's."""
    workload = {"config": {"block_size": 4, "num_blocks": 64, "max_num_seqs": 3, "max_num_batched_tokens": 64,
                           "eos": 0}, "requests": requests(5, 6, 9)}
    ref, opt = twin_run(workload, 4)
    rb, _ = ref.schedule()
    ob, is_prefill = opt.schedule()
    assert not is_prefill
    assert opt._group.members == opt.running[: len(opt._group.members)] == ob
    fields = ("num_tokens", "num_cached_tokens", "num_scheduled_tokens", "is_prefill", "block_table", "token_ids",
              "num_completion_tokens", "last_token")
    for r, o in zip(rb, ob, strict=True):
        assert [getattr(r, f) for f in fields] == [getattr(o, f) for f in fields]
    assert all(s.num_scheduled_tokens == 1 and not s.is_prefill for s in ob)


@pytest.mark.clause("OPT-4")
def test_decode_without_pressure_never_takes_the_preemption_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """OPT-4: enough free blocks for every member that needs one: no per-sequence can_append loop."""
    def forbidden(self: Scheduler, due: list[Sequence]) -> None:
        raise AssertionError("preemption path taken without pressure")

    monkeypatch.setattr(Scheduler, "_decode_with_preemption", forbidden)
    workload = {"config": {"block_size": 2, "num_blocks": 200, "max_num_seqs": 8, "max_num_batched_tokens": 64,
                           "eos": 0}, "requests": requests(6, 3, 12)}
    ref, opt = twin_run(workload, 100)
    assert ref.is_finished() and opt.is_finished()


@pytest.mark.clause("OPT-5")
def test_preemption_takes_the_newest_and_matches_the_reference() -> None:
    """OPT-5: under pressure the group visits its needy members in order and preempts from the tail."""
    workload = {"config": {"block_size": 2, "num_blocks": 9, "max_num_seqs": 8, "max_num_batched_tokens": 64,
                           "eos": 0}, "requests": requests(4, 3, 8)}
    preempted = 0
    ref, opt = twin_run(workload, 0)
    while not ref.is_finished():
        before = {s.seq_id for s in opt.running}
        (rb, rp), (ob, op) = ref.schedule(), opt.schedule()
        preempted += len(before & {s.seq_id for s in opt.waiting})
        assert [s.block_table for s in rb] == [s.block_table for s in ob]
        assert [len(s) for s in ref.waiting] == [len(s) for s in opt.waiting]
        ref.postprocess(rb, [1] * len(rb), rp)
        opt.postprocess(ob, [1] * len(ob), op)
    assert preempted > 0


@pytest.mark.clause("OPT-3")
def test_a_batch_handed_back_as_a_copy_decides_the_same() -> None:
    """OPT-3: postprocess on a copy of the decode batch dissolves the group with each member's grant of one token.

    Every other step hands back a copy; the counters, the hashes and every later decision stay the reference's.
    """
    p = Pair(block_size=2, num_blocks=40, max_num_seqs=4, max_num_batched_tokens=16)
    for i in range(4):
        p.add([i + 1, i + 2, i + 3], 7 + i)
    steps = 0
    while p.step(copy_batch=steps % 2 == 1):
        steps += 1
        p.agree()
    assert steps > 6
