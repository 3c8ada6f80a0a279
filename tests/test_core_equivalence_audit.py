"""The audit of the mutants once called equivalent (spec/mutation.md, MUT-8): the inputs that told them apart.

Each test here fails on the code before its fix, or on the mutant it names: a stop id no int64 token can
equal (it made the unmutated core raise OverflowError at a decode), a second postprocess of one step (two
mutants decided it differently), and add/abort churn that grew a mutated arena without bound.
"""

from __future__ import annotations

from typing import Any

import pytest

from optimized.core.config import SchedulerConfig
from optimized.core.errors import EmptyDecodeError
from optimized.core.scheduler import Scheduler
from optimized.core.token_arena import TokenArena
from optimized.verify.conformance import implementation

IMPLEMENTATIONS = ("reference", "optimized")
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


@pytest.mark.clause("OPT-10", "OPT-23", "ARCH-4")
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("bad", [1 << 63, INT64_MIN - 1, 1 << 200])
def test_a_stop_id_no_int64_token_can_equal_is_refused_and_changes_nothing(name: str, bad: int) -> None:
    """OPT-10, OPT-23: five stop ids, one of them 2**63, once made the optimized core raise OverflowError at the
    first decode postprocess (numpy cannot hold it as an int64); both ports now refuse it at ``add``."""
    port = implementation(name)(SchedulerConfig(block_size=2, num_blocks=8))
    port.add(port.new_sequence([1, 2, 3], 2))
    before = port.snapshot()
    seq = port.new_sequence([4, 5], 3)
    with pytest.raises(ValueError, match="stop_token_ids must be int64 integers"):
        port.add(seq, {5, 6, 7, 8, bad})
    assert port.snapshot() == before
    port.add(seq, {5, 6, 7, 8})  # refused, it was not added: it may be added now
    assert [s.seq_id for s in port.waiting][-1] == seq.seq_id


@pytest.mark.clause("OPT-23")
@pytest.mark.parametrize("count", [4, 5])
def test_stop_ids_at_the_int64_bounds_decode_to_the_end(count: int) -> None:
    """OPT-23: the widest ids an int64 token can equal are watched by the decode group on either of its paths
    (a few comparisons up to four ids, np.isin past four) and finish nobody who did not draw them."""
    ports = [implementation(name)(SchedulerConfig(block_size=2, num_blocks=16, eos=0)) for name in IMPLEMENTATIONS]
    stops = {INT64_MAX, INT64_MIN, 7, 8, 9}
    finished: list[list[list[int]]] = []
    for port in ports:
        seqs = [port.new_sequence([1, 2, 3], 4) for _ in range(3)]
        for seq in seqs:
            port.add(seq, set(sorted(stops)[:count]))
        ends: list[list[int]] = []
        while not port.is_finished():
            out = port.schedule()
            done = port.postprocess(out.batch, [INT64_MAX if out.batch[0] is seqs[1] and not out.is_prefill else 1]
                                    * len(out.batch), out.is_prefill)
            ends.append([seqs.index(s) for s in done])
        finished.append(ends)
    assert finished[0] == finished[1]
    assert any(ends for ends in finished[0])


@pytest.mark.clause("OPT-25")
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_a_second_postprocess_of_one_step_is_refused_and_changes_nothing(name: str) -> None:
    """OPT-25: postprocess twice after one schedule() appended a second token with no grant behind it; each
    schedule() is now postprocessed once, in prefill and in decode (the group's fast path and the per-sequence
    one), and an empty batch with no step awaiting is still nothing."""
    port: Any = implementation(name)(SchedulerConfig(block_size=2, num_blocks=16, eos=0))
    assert port.postprocess([], [], True) == []
    a, b = port.new_sequence([1, 2, 3], 6), port.new_sequence([4, 5], 6)
    port.add(a, {9})
    port.add(b)
    with pytest.raises(RuntimeError, match="no scheduled step awaits it"):
        port.postprocess([a], [1], True)  # nothing scheduled yet
    finished = []
    for step in range(4):
        out = port.schedule()
        tokens = [9 if step == 3 else 1] * len(out.batch)
        finished += port.postprocess(out.batch, tokens, out.is_prefill)
        before = port.snapshot()
        for batch in (out.batch, list(out.batch)):  # the list schedule() returned, and a copy of it
            with pytest.raises(RuntimeError, match="no scheduled step awaits it"):
                port.postprocess(batch, tokens, out.is_prefill)
            assert port.snapshot() == before
    assert finished == [a] and [s.seq_id for s in port.running] == [b.seq_id]  # the stop finished a, once


@pytest.mark.clause("OPT-25")
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_a_step_withdrawn_or_scheduled_again_awaits_no_postprocess(name: str) -> None:
    """OPT-25: after abort_step, or a schedule() that raised the empty decode, the earlier batch is no step's."""
    port: Any = implementation(name)(SchedulerConfig(block_size=2, num_blocks=2, max_num_batched_tokens=8))
    seq = port.new_sequence([1, 2], 6)
    port.add(seq)
    out = port.schedule()
    port.postprocess(out.batch, [1], True)  # length 3: the next decode takes the last free block
    out = port.schedule()
    assert not out.is_prefill and len(seq.block_table) == 2
    with pytest.raises(EmptyDecodeError):  # scheduled again, unposted: no block left, it preempts itself
        port.schedule()
    with pytest.raises(RuntimeError, match="no scheduled step awaits it"):
        port.postprocess(out.batch, [1], False)
    other = implementation(name)(SchedulerConfig(block_size=2, num_blocks=8))
    s = other.new_sequence([1, 2, 3], 4)
    other.add(s)
    out = other.schedule()
    other.abort_step(out.batch)
    with pytest.raises(RuntimeError, match="no scheduled step awaits it"):
        other.postprocess(out.batch, [1], True)


@pytest.mark.clause("OPT-26")
def test_add_abort_churn_never_grows_the_arena_past_four_times_what_it_holds() -> None:
    """OPT-26: packing sizes the array from the live regions only; with released regions counted as live
    (``top + dead``, or ``dead`` never counted) each packing doubled an array that churn keeps full, and ``add``
    ran out of memory after about 1,170 add/abort pairs of max_tokens near 2**20."""
    sched = Scheduler(SchedulerConfig(block_size=2, num_blocks=8))
    sched._arena = TokenArena(on_move=sched._group.refresh_positions, capacity=64)  # packs early and often
    live: list[Any] = []
    peak = 0
    for i in range(400):
        seq = sched.new_sequence([1, 2, 3], 1 + (i * 37) % 200)
        sched.add(seq)
        live.append(seq)
        peak = max(peak, sum(s.num_prompt_tokens + s.max_tokens for s in live))
        assert sched._arena.data.shape[0] <= max(64, 4 * peak), (i, sched._arena.data.shape[0], peak)
        if len(live) > 2:
            sched.abort(live.pop(i % 3))
