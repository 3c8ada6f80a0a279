"""Abort and failed steps in the optimized scheduler, against reference.extensions (OPT-19..21)."""


from __future__ import annotations

import pytest

from invariants import snapshot
from optimized.core.scheduler import Scheduler, SchedulerConfig, Sequence
from optimized.engine.sampling_params import SamplingParams
from tests.optimized_pair import Pair


def aborted(p: Pair, index: int) -> None:
    p.ref.abort(p.ref_seqs[index])
    p.opt.abort(p.opt_seqs[index])
    p.agree()


@pytest.mark.clause("OPT-19", "OPT-20")
def test_abort_a_waiting_sequence_then_run_on() -> None:
    """OPT-19, OPT-20: a waiting request leaves; the rest run as on the reference."""
    p = Pair(block_size=4, num_blocks=30, max_num_seqs=2, max_num_batched_tokens=16)
    for i in range(4):
        p.add([i + 1] * 6, 5)
    p.step()
    aborted(p, 3)
    assert p.opt_seqs[3].status.name == "FINISHED" and p.opt_seqs[3].token_ids == [4] * 6
    while p.step():
        p.agree()


@pytest.mark.clause("OPT-20")
def test_abort_mid_chunk_keeps_the_filled_blocks_for_a_later_hit() -> None:
    """OPT-20: waiting[0] aborted between chunks releases its table in reverse; its filled blocks are hit later."""
    p = Pair(block_size=4, num_blocks=30, max_num_seqs=4, max_num_batched_tokens=6)
    prompt = list(range(1, 15))
    p.add(prompt, 4)
    p.step()
    p.step()
    head = p.opt_seqs[0]
    assert head.status.name == "WAITING" and head.block_table and head.num_cached_tokens == 12
    table = list(head.block_table)
    free_before = p.opt.block_manager.free_block_ids
    aborted(p, 0)
    assert p.opt.block_manager.free_block_ids == [*free_before, *reversed(table)]
    again = p.add(prompt, 3)
    p.step()
    assert p.opt_seqs[again].block_table[:3] == p.ref_seqs[again].block_table[:3] == table[:3]  # three hits
    while p.step():
        p.agree()


@pytest.mark.clause("OPT-20")
@pytest.mark.parametrize("position", [0, 2, 4])
def test_abort_a_decode_group_member_at_any_position(position: int) -> None:
    """OPT-20: a member leaves the group and running at its index; later requests hit its cached blocks."""
    p = Pair(block_size=2, num_blocks=80, max_num_seqs=8, max_num_batched_tokens=64)
    prompts = [[i + 1] * 5 for i in range(5)]
    for prompt in prompts:
        p.add(prompt, 12)
    for _ in range(4):
        p.step()
    group = p.opt._group
    victim = p.opt.running[position]
    assert victim in group.members and group.members == p.opt.running[: len(group.members)]
    held = list(victim.block_table)
    aborted(p, position)
    assert victim not in group.members and group.members == p.opt.running[: len(group.members)]
    later = p.add(p.ref_seqs[position].token_ids, 3)  # 9 tokens: its first 4 blocks are full and cached
    p.step()
    assert p.opt_seqs[later].block_table[:4] == p.ref_seqs[later].block_table[:4] == held[:4]
    while p.step():
        p.agree()


@pytest.mark.clause("OPT-19")
def test_abort_refuses_mid_step_and_strangers_changing_nothing() -> None:
    """OPT-19: RuntimeError between schedule and postprocess; ValueError for a sequence not waiting or running."""
    p = Pair(block_size=4, num_blocks=20, max_num_seqs=4, max_num_batched_tokens=32)
    for i in range(2):
        p.add([i + 1] * 5, 3)
    p.step()
    batch, is_prefill = p.opt.schedule()
    before = snapshot(p.opt)
    with pytest.raises(RuntimeError, match="between steps"):
        p.opt.abort(batch[0])
    assert snapshot(p.opt) == before
    p.opt.postprocess(batch, [1] * len(batch), is_prefill)
    other = Scheduler(SchedulerConfig(num_blocks=4, block_size=4))
    elsewhere = Sequence([1, 2], SamplingParams(), 4)
    other.add(elsewhere)
    before = snapshot(p.opt)
    for stranger in (Sequence([1], SamplingParams(), 4), elsewhere):
        with pytest.raises(ValueError, match="not waiting or running"):
            p.opt.abort(stranger)
    assert snapshot(p.opt) == before and list(other.waiting) == [elsewhere]
    while not p.opt.is_finished():
        b, pf = p.opt.schedule()
        p.opt.postprocess(b, [1] * len(b), pf)
    before = snapshot(p.opt)
    with pytest.raises(ValueError, match="not waiting or running"):
        p.opt.abort(p.opt_seqs[0])
    assert snapshot(p.opt) == before


@pytest.mark.clause("OPT-21")
def test_abort_step_withdraws_a_failed_decode_batch_like_the_reference() -> None:
    """OPT-21: a failed decode step's members are aborted in batch order; the run goes on identically."""
    p = Pair(block_size=2, num_blocks=9, max_num_seqs=4, max_num_batched_tokens=32)
    for i in range(3):
        p.add([i + 1] * 3, 6)
    for _ in range(3):
        p.step()
    rb, _ = p.ref.schedule()
    ob, _ = p.opt.schedule()
    with pytest.raises(ValueError, match="exactly the sequences"):
        p.opt.abort_step(ob[:-1])
    p.ref.abort_step(rb)
    p.opt.abort_step(ob)
    p.agree()
    p.add([7, 7, 7], 4)
    while p.step():
        p.agree()
