"""One suite, run against both schedulers through the scheduler port (ARCH-4), as CPython runs one heapq suite
against its C and its Python implementation.

Every check is computed from the port's own snapshots, never from an implementation's insides: whom a step
preempted, what it took from the prefix cache, whom a postprocess finished, and every block the ``BlockReader``
reads. A port that misreports fails the same checks (``test_the_suite_bites``), so they cannot pass vacuously.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pytest

import reference
from invariants import SchedulerState, check_state, seq_view
from optimized.core.config import POLICIES, SchedulerConfig
from optimized.core.errors import EmptyDecodeError
from optimized.core.port import PortFactory, ScheduleOutput, SchedulerPort
from optimized.core.scheduler import Scheduler
from optimized.verify.conformance import implementation, parse_workload, replay
from optimized.verify.reference_port import ReferenceBlocks, ReferencePort
from tests.optimized_pair import SAMPLES

IMPLEMENTATIONS = ("reference", "optimized")
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
Model = Callable[[Any], int]


def the_model(seq: Any) -> int:
    """A token that depends on the sequence, never EOS 0."""
    return 1 + (len(seq) * 7) % 5


def ports(config: SchedulerConfig) -> list[SchedulerPort[Any]]:
    """Both implementations as ports (mypy checks that each is one)."""
    return [ReferencePort(config), Scheduler(config)]


def blocks_agree(port: SchedulerPort[Any], state: SchedulerState) -> None:
    """The ``BlockReader`` reads, one block at a time, what a full snapshot holds."""
    blocks = port.blocks
    assert (blocks.num_blocks, blocks.num_free) == (state.num_blocks, len(state.free_block_ids))
    for view in state.blocks:
        b = view.block_id
        assert (blocks.is_used(b), blocks.ref_count(b), blocks.block_hash(b), blocks.token_ids_of(b)) == \
               (b in state.used_block_ids, view.ref_count, view.hash, view.token_ids), f"block {b}"


def checked_step(port: SchedulerPort[Any], model: Model = the_model) -> tuple[ScheduleOutput[Any], list[Any]]:
    """One schedule() and postprocess(), each report checked against the snapshots around it."""
    before = port.snapshot()
    out = port.schedule()
    after = port.snapshot()
    # Preempted: the running sequences sent back to waiting, in the order preempted (the tail first, PREEMPT-2).
    waiting_now = {s.seq_id for s in after.waiting}
    assert [s.seq_id for s in out.preempted] == [s.seq_id for s in reversed(before.running) if s.seq_id in waiting_now]
    # Prefix hits: the sequences admitted this step (no blocks before it), what they took from the cache.
    fresh = {s.seq_id for s in before.waiting if not s.block_table}
    admitted = [s for s in out.batch if s.seq_id in fresh] if out.is_prefill else []
    assert (out.prefix_hit_tokens, out.prefix_query_tokens) == (sum(s.num_cached_tokens for s in admitted),
                                                                sum(s.num_tokens for s in admitted))
    blocks_agree(port, after)
    ids = [s.seq_id for s in out.batch]
    finished = port.postprocess(out.batch, [model(s) for s in out.batch], out.is_prefill)
    end = port.snapshot()
    live = {s.seq_id for s in (*end.waiting, *end.running)}
    assert [s.seq_id for s in finished] == [i for i in ids if i not in live]  # in batch order
    blocks_agree(port, end)
    assert check_state(end) == []
    return out, finished


def shared_prefix_run(factory: PortFactory) -> list[tuple[ScheduleOutput[Any], list[Any]]]:
    """Four requests sharing a prefix in a small cache: prefix hits, preemption, finishes (OPT-22's workload)."""
    port = factory(SchedulerConfig(block_size=2, num_blocks=9, max_num_seqs=4, max_num_batched_tokens=32, eos=0))
    port.add(port.new_sequence([5, 6, 7, 8, 1], 6))
    steps = [checked_step(port)]
    while not port.running:
        steps.append(checked_step(port))
    for i in range(3):
        port.add(port.new_sequence([5, 6, 7, 8, i + 2], 6))
    while not port.is_finished():
        steps.append(checked_step(port))
    return steps


@pytest.mark.clause("ARCH-4", "OPT-22")
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_a_step_reports_whom_it_preempted_what_it_hit_and_whom_it_finished(name: str) -> None:
    """ARCH-4, OPT-22: the typed output and postprocess's return are what the snapshots around them show."""
    steps = shared_prefix_run(implementation(name))
    assert any(out.preempted for out, _ in steps)
    assert any(out.prefix_hit_tokens for out, _ in steps)
    assert sum(len(finished) for _, finished in steps) == 4
    batch, is_prefill = steps[0][0]  # the lesson's pair
    assert (batch, is_prefill) == (steps[0][0].batch, True)


@pytest.mark.clause("ARCH-4")
def test_both_ports_decide_the_same() -> None:
    """ARCH-4, OPT-1: the same reports, step by step, by arrival order (each numbers its sequences itself)."""
    def reports(factory: PortFactory) -> list[tuple[Any, ...]]:
        first: list[int] = []

        def arrival(seq: Any) -> int:
            if not first:
                first.append(seq.seq_id)
            return int(seq.seq_id) - first[0]

        out = []
        for step, finished in shared_prefix_run(factory):
            out.append((step.is_prefill, [(arrival(s), s.num_scheduled_tokens, list(s.block_table))
                                          for s in step.batch],
                        [arrival(s) for s in step.preempted], step.prefix_hit_tokens, step.prefix_query_tokens,
                        [arrival(s) for s in finished]))
        return out

    assert reports(implementation("reference")) == reports(implementation("optimized"))


@pytest.mark.clause("ARCH-4", "OPT-9", "EDGE-2", "CONF-4")
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_the_empty_decode_is_the_one_error_and_leaves_the_lessons_state(name: str) -> None:
    """ARCH-4, OPT-9, EDGE-2: a request that outgrows the cache alone ends in EmptyDecodeError, whichever scheduler:
    the sequence preempted itself back to the front of waiting, running empty, every block free; the scheduler
    stays usable (it raises the same again)."""
    port = implementation(name)(SchedulerConfig(block_size=2, num_blocks=2, max_num_batched_tokens=8, eos=0))
    seq = port.new_sequence([1, 2, 3], 4)
    port.add(seq)
    with pytest.raises(EmptyDecodeError):
        while True:
            checked_step(port)
    state = port.snapshot()
    assert [s.seq_id for s in state.waiting] == [seq.seq_id] and state.running == []
    assert seq.block_table == [] and len(state.free_block_ids) == 2 and check_state(state) == []
    with pytest.raises(EmptyDecodeError):
        port.schedule()


@pytest.mark.clause("ARCH-4", "CONF-4")
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_the_samples_that_end_in_the_empty_decode_replay_through_the_port(name: str) -> None:
    """ARCH-4, CONF-4: the replay loop catches the port's one error, wherever the implementation raised it."""
    for sample in SAMPLES:
        if sample["trace"][-1].get("error"):
            assert replay(parse_workload(sample["workload"]), implementation(name)) == sample["trace"]


class NotTheEmptyDecode(reference.Scheduler):
    """A lesson whose schedule() fails some other assert while sequences still run."""

    def schedule(self) -> tuple[list[reference.Sequence], bool]:
        batch, is_prefill = super().schedule()
        assert not self.running, "another invariant of the lesson"
        return batch, is_prefill


@pytest.mark.clause("ARCH-4")
def test_the_adapter_maps_only_the_lessons_empty_decode_assert() -> None:
    """ARCH-4: an AssertionError that does not leave the empty decode's state (running empty, something waiting)
    propagates as it is: it is a broken lesson, not the EDGE-2 edge."""
    port = ReferencePort(SchedulerConfig(block_size=2, num_blocks=4), lesson=NotTheEmptyDecode)
    port.add(port.new_sequence([1, 2], 3))
    with pytest.raises(AssertionError, match="another invariant") as raised:
        port.schedule()
    assert not isinstance(raised.value, EmptyDecodeError)


@pytest.mark.clause("ARCH-4")
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_add_refuses_the_same_things_on_both_and_changes_nothing(name: str) -> None:
    """ARCH-4: a sequence added twice, ``max_tokens`` 0, a stop id that is not an int: a ValueError from either
    port, and the queues and blocks are as they were."""
    port = implementation(name)(SchedulerConfig(block_size=2, num_blocks=8))
    seq = port.new_sequence([1, 2, 3], 2)
    port.add(seq)
    before = port.snapshot()
    cases: list[tuple[Any, Any, str]] = [(seq, (), "already added"), (port.new_sequence([1], 0), (), "max_tokens"),
                                          (port.new_sequence([1], 2), ("x",), "stop_token_ids")]
    for bad, stops, what in cases:
        with pytest.raises(ValueError, match=what):
            port.add(bad, stops)
        assert port.snapshot() == before


@pytest.mark.clause("ARCH-4", "EDGE-2")
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_an_empty_scheduler_asked_to_schedule_raises_the_one_error(name: str) -> None:
    """ARCH-4, EDGE-2: with nothing queued the lesson's ``assert scheduled_seqs`` fires too (nothing waits, nothing
    runs): both ports raise EmptyDecodeError, so a trace whose idle step records it replays on either."""
    port = implementation(name)(SchedulerConfig(block_size=2, num_blocks=4))
    with pytest.raises(EmptyDecodeError):
        port.schedule()


@pytest.mark.clause("ARCH-4")
def test_the_block_managers_own_assert_is_not_the_empty_decode() -> None:
    """ARCH-4: an assert of the lesson's block manager, fired in a prefill with nothing running (a corrupted free
    block), propagates as the AssertionError it is: only ``schedule()``'s own assert is the empty decode."""
    port = ReferencePort(SchedulerConfig(block_size=2, num_blocks=4))
    free = port.lesson_scheduler.block_manager.free_block_ids[0]
    port.lesson_scheduler.block_manager.blocks[free].ref_count = 1  # corrupt: a free block still referenced
    port.add(port.new_sequence([1, 2, 3], 2))
    with pytest.raises(AssertionError) as raised:
        port.schedule()
    assert not isinstance(raised.value, EmptyDecodeError)


@pytest.mark.clause("ARCH-4", "OPT-24")
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_a_stop_set_given_to_add_finishes_its_sequence(name: str) -> None:
    """ARCH-4, OPT-24: ``add``'s stop set finishes a sequence that draws one, in prefill and in decode; another
    sequence that draws the same token goes on."""
    port = implementation(name)(SchedulerConfig(block_size=2, num_blocks=16, max_num_batched_tokens=16, eos=0))
    stopped_at_prefill, stopped_later, other = (port.new_sequence([1, 2, 3], 8) for _ in range(3))
    port.add(stopped_at_prefill, {7})
    port.add(stopped_later, {9})
    port.add(other)
    _, finished = checked_step(port, lambda s: 7)
    assert finished == [stopped_at_prefill]
    _, finished = checked_step(port, lambda s: 9 if s is stopped_later else 7)
    assert finished == [stopped_later]
    assert [s.seq_id for s in port.running] == [other.seq_id] and other.num_completion_tokens == 2


@pytest.mark.clause("ARCH-4", "ABORT-1", "ABORT-4", "FAULT-2")
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_abort_and_a_failed_step_through_the_port(name: str) -> None:
    """ARCH-4, ABORT-1, ABORT-4, FAULT-2: abort takes a live sequence back between steps and refuses a stranger
    (ValueError) or a step in flight (RuntimeError); abort_step takes exactly the scheduled batch back."""
    port = implementation(name)(SchedulerConfig(block_size=2, num_blocks=16, max_num_batched_tokens=16, eos=0))
    seqs = [port.new_sequence([i + 1] * 3, 8) for i in range(3)]
    for seq in seqs:
        port.add(seq)
    checked_step(port)
    port.abort(seqs[1])
    with pytest.raises(ValueError, match="not waiting or running"):
        port.abort(seqs[1])
    out = port.schedule()
    with pytest.raises(RuntimeError, match="only between steps"):
        port.abort(seqs[0])
    with pytest.raises(ValueError, match="exactly the sequences"):
        port.abort_step(out.batch[:-1])
    port.abort_step(out.batch)
    state = port.snapshot()
    assert state.waiting == state.running == [] and state.used_block_ids == set() and check_state(state) == []
    blocks_agree(port, state)


@pytest.mark.clause("ARCH-4")
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_a_new_sequence_is_one_the_port_takes(name: str) -> None:
    """ARCH-4: ``new_sequence`` makes a waiting sequence of the config's block size with the given parameters."""
    config = SchedulerConfig(block_size=4, num_blocks=8)
    port = implementation(name)(config)
    assert port.config == config
    seq = port.new_sequence([3, 1, 4, 1, 5], 7, ignore_eos=True, temperature=0.5)
    assert (seq_view(seq).status, seq.token_ids, seq.max_tokens, seq.ignore_eos, seq.temperature) == \
           ("WAITING", [3, 1, 4, 1, 5], 7, True, 0.5)
    port.add(seq)
    out = port.schedule()
    assert out.batch == [seq] and seq.block_table == [0, 1] and port.blocks.ref_count(1) == 1


class HidesPreemptions(ReferencePort):
    def schedule(self) -> ScheduleOutput[reference.Sequence]:
        out = super().schedule()
        return ScheduleOutput(out.batch, out.is_prefill, (), out.prefix_hit_tokens, out.prefix_query_tokens)


class HidesFinishes(ReferencePort):
    def postprocess(self, seqs: list[reference.Sequence], token_ids: list[int],
                    is_prefill: bool) -> list[reference.Sequence]:
        super().postprocess(seqs, token_ids, is_prefill)
        return []


class MiscountsHits(ReferencePort):
    def schedule(self) -> ScheduleOutput[reference.Sequence]:
        out = super().schedule()
        out.prefix_hit_tokens = 0
        return out


class UndercountingBlocks(ReferenceBlocks):
    def ref_count(self, block_id: int) -> int:
        return min(super().ref_count(block_id), 1)


class MisreadsRefCounts(ReferencePort):
    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.blocks = UndercountingBlocks(self.lesson_scheduler.block_manager)


@pytest.mark.clause("ARCH-4")
@pytest.mark.parametrize("broken", [HidesPreemptions, HidesFinishes, MiscountsHits, MisreadsRefCounts,
                                    partial(ReferencePort, lesson=NotTheEmptyDecode)])
def test_the_suite_bites(broken: PortFactory) -> None:
    """ARCH-4: a port that misreports a step or a block fails the suite's checks."""
    with pytest.raises(AssertionError):
        shared_prefix_run(broken)


@pytest.mark.clause("KNOB-4", "EDGE-1")
@pytest.mark.parametrize(("field", "value"), [
    ("block_size", 1), ("block_size", 0), ("num_blocks", 0), ("max_num_seqs", 0),
    ("max_num_batched_tokens", 0), ("num_blocks", 2.0), ("eos", True), ("max_num_seqs", None),
])
def test_the_cores_config_refuses_bad_knobs_naming_the_field(field: str, value: object) -> None:
    """KNOB-4, EDGE-1: the core's own config validates as the reference's does; the least values pass."""
    kwargs: dict[str, object] = {"num_blocks": 4, "block_size": 4, field: value}
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]
    least = SchedulerConfig(num_blocks=1, block_size=2, max_num_seqs=1, max_num_batched_tokens=1, eos=-(1 << 63))
    assert (least.num_blocks, least.block_size, least.max_num_seqs, least.max_num_batched_tokens) == (1, 2, 1, 1)
    assert all(isinstance(p, (ReferencePort, Scheduler)) for p in ports(least))



@pytest.mark.clause("OPT-10", "OPT-24", "ARCH-4")
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("bad", [1 << 63, INT64_MIN - 1, 1 << 200])
def test_a_stop_id_no_int64_token_can_equal_is_refused_and_changes_nothing(name: str, bad: int) -> None:
    """OPT-10, OPT-24: five stop ids, one of them 2**63, once made the optimized core raise OverflowError at the
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


@pytest.mark.clause("OPT-24")
@pytest.mark.parametrize("count", [4, 5])
def test_stop_ids_at_the_int64_bounds_decode_to_the_end(count: int) -> None:
    """OPT-24: the widest ids an int64 token can equal are watched by the decode group on either of its paths
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


@pytest.mark.clause("OPT-23")
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_a_second_postprocess_of_one_step_is_refused_and_changes_nothing(name: str) -> None:
    """OPT-23: postprocess twice after one schedule() appended a second token with no grant behind it; each
    schedule() is now postprocessed once, in prefill and in decode (the group's fast path and the per-sequence
    one), and an empty batch with no step awaiting is still nothing."""
    port: Any = implementation(name)(SchedulerConfig(block_size=2, num_blocks=16, eos=0))
    a, b = port.new_sequence([1, 2, 3], 6), port.new_sequence([4, 5], 6)
    port.add(a, {9})
    port.add(b)
    with pytest.raises(RuntimeError, match="no scheduled step awaits it"):
        port.postprocess([a], [1], True)  # nothing scheduled yet
    assert port.postprocess([], [], True) == []
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


@pytest.mark.clause("OPT-23")
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_a_step_withdrawn_or_never_returned_awaits_no_postprocess(name: str) -> None:
    """OPT-23: after abort_step, or a schedule() that raised the empty decode, the earlier batch is no step's."""
    port: Any = implementation(name)(SchedulerConfig(block_size=2, num_blocks=2, max_num_batched_tokens=8))
    seq = port.new_sequence([1, 2], 6)
    port.add(seq)
    lengths = []
    with pytest.raises(EmptyDecodeError):  # at length 5 its third block is not there: it preempts itself
        for _ in range(6):
            out = port.schedule()
            port.postprocess(out.batch, [1], out.is_prefill)
            lengths.append(len(seq))
    assert lengths == [3, 4, 5] and not port.running
    with pytest.raises(RuntimeError, match="no scheduled step awaits it"):
        port.postprocess(out.batch, [1], False)
    other = implementation(name)(SchedulerConfig(block_size=2, num_blocks=8))
    s = other.new_sequence([1, 2, 3], 4)
    other.add(s)
    out = other.schedule()
    other.abort_step(out.batch)
    with pytest.raises(RuntimeError, match="no scheduled step awaits it"):
        other.postprocess(out.batch, [1], True)


PRIORITIES = (0, 0, -1)  # by arrival, under ``priority``


def policy_port(name: str, policy: str) -> Any:
    """A port of ``name``'s implementation under ``policy``, holding three requests (two share a prefix, the last
    is urgent under ``priority``), added in that order."""
    config = SchedulerConfig(block_size=2, num_blocks=24, max_num_batched_tokens=8, eos=0, policy=policy,
                             patience=1)
    port: Any = implementation(name)(config)
    prompts = (([5, 6, 7, 8, 1], 5), ([3, 4, 5], 2), ([5, 6, 7, 8, 2], 8))
    for (tokens, max_tokens), priority in zip(prompts, PRIORITIES, strict=True):
        port.add(port.new_sequence(tokens, max_tokens), priority=priority if policy == "priority" else 0)
    return port


@pytest.mark.clause("OPT-27", "ARCH-4")
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_a_second_schedule_before_the_postprocess_is_refused_and_changes_nothing(name: str, policy: str) -> None:
    """OPT-27: schedule() again while the last batch awaits its postprocess (or abort_step) raised nothing and
    decided on a state the lesson never reaches (a granted step granted again); now it is refused on both ports,
    under every policy, in every kind of step, and the step it refused is then postprocessed as if alone."""
    port = policy_port(name, policy)
    kinds = set()
    while not port.is_finished():
        out = port.schedule()
        kinds.add((out.is_prefill, len(out.batch) > 1))
        before = port.snapshot()
        with pytest.raises(RuntimeError, match="awaits its postprocess or abort_step"):
            port.schedule()
        assert port.snapshot() == before
        port.postprocess(out.batch, [1] * len(out.batch), out.is_prefill)
    assert kinds >= {(True, True), (False, True), (False, False)}  # prefills and decodes, of one and of several
    port = policy_port(name, policy)
    port.abort_step(port.schedule().batch)  # a withdrawn step awaits nothing: the next schedule() runs
    assert port.schedule().batch


@pytest.mark.clause("OPT-23")
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_a_postprocess_of_another_batch_is_refused_and_changes_nothing(name: str, policy: str) -> None:
    """OPT-23: the awaiting step takes its own batch only (that list or a copy, in order): a reordered, shorter,
    longer or empty list would hand tokens to sequences no step granted them to."""
    port = policy_port(name, policy)
    stranger = port.new_sequence([9, 9], 3)
    reordered = 0
    while not port.is_finished():
        out = port.schedule()
        batch = out.batch
        before = port.snapshot()
        # The running queue itself is refused even where it holds the batch, in order: it changes under the loop.
        others = [batch[1:], [*batch, stranger], [], port.running] + ([batch[::-1]] if len(batch) > 1 else [])
        for seqs in others:
            with pytest.raises(ValueError, match="seqs must be the batch the last schedule"):
                port.postprocess(seqs, [1] * len(seqs), out.is_prefill)
            assert port.snapshot() == before
        if len(batch) > 1:  # the very list schedule() returned, reordered in place, is no longer the batch
            batch.reverse()
            with pytest.raises(ValueError, match="seqs must be the batch the last schedule"):
                port.postprocess(batch, [1] * len(batch), out.is_prefill)
            assert port.snapshot() == before
            batch.reverse()
            reordered += 1
        port.postprocess(list(batch), [1] * len(batch), out.is_prefill)  # a copy, in order, is the batch
    assert reordered


@pytest.mark.clause("OPT-23")
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_tokens_that_are_not_int64_are_refused_and_the_step_still_awaits(name: str, policy: str) -> None:
    """OPT-23: fewer tokens than sequences, or one that is no int64 integer, are refused before anything changes,
    in every kind of step and wherever the bad one is, naming it (the core once took the tokens before it,
    raised, and a retry gave a sequence two tokens; the reference took any value and failed steps later, hashing
    it; a short list made the two ports decide apart). The step still awaits its postprocess, which then takes
    int64's bounds, from a list or an array, and keeps each token as given."""
    port = policy_port(name, policy)
    huge = INT64_MAX + 1
    kinds = set()
    steps = 0
    while not port.is_finished():
        running = {s.seq_id for s in port.running}
        out = port.schedule()
        n = len(out.batch)
        kinds.add(("decodes" if out.batch[0].seq_id in running else "") + ("+prefills" if out.is_prefill else ""))
        before = port.snapshot()
        bad = {"[1]*(n-1)": [1] * (n - 1), "[huge]": [1] * (n - 1) + [huge], "(huge,)": (huge, *[1] * (n - 1)),
               "[min-1]": [1] * (n - 1) + [INT64_MIN - 1], "[1.0]": [1] * (n - 1) + [1.0],
               "uint64": np.array([1] * (n - 1) + [huge], dtype=np.uint64),
               "object": np.array([huge, *[1] * (n - 1)], dtype=object), "floats": np.ones(n),
               "2-d": np.ones((n, 1), dtype=np.int64), "dict": dict.fromkeys(range(n), 1), "set": set(range(n))}
        named = {"[1]*(n-1)": f"sequences, got {n - 1}", "[huge]": repr(huge), "(huge,)": repr(huge),
                 "[min-1]": repr(INT64_MIN - 1), "[1.0]": "1.0", "uint64": repr(huge), "object": repr(huge),
                 "floats": "an array of float64", "2-d": f"shape ({n}, 1)", "dict": "object of shape ()",
                 "set": "object of shape ()"}
        for seqs in (out.batch, list(out.batch)):
            for what, tokens in bad.items():
                with pytest.raises(ValueError, match="postprocess: token_ids must") as refused:
                    port.postprocess(seqs, tokens, out.is_prefill)
                assert named[what] in str(refused.value), what
                assert port.snapshot() == before, what
        with pytest.raises(RuntimeError, match="awaits its postprocess"):
            port.schedule()
        # int64's bounds as a list, an int64 array and (the upper one) a uint64 array, in turn.
        bounds = [(INT64_MIN, INT64_MAX)[j % 2] for j in range(n)]
        given: Any = (bounds, np.array(bounds), np.full(n, INT64_MAX, np.uint64))[steps % 3]
        lengths = [len(s) for s in out.batch]
        port.postprocess(out.batch, given, out.is_prefill)
        kept = [(s.token_ids[-1], t) for s, t, was in zip(out.batch, list(given), lengths, strict=True)
                if len(s) > was]
        assert kept and all(a == b for a, b in kept)
        steps += 1
    assert {"+prefills", "decodes"} <= kinds and ("decodes+prefills" in kinds) == (policy == "mixed")


@pytest.mark.clause("ARCH-4")
@pytest.mark.parametrize("policy", POLICIES)
def test_policy_state_is_the_same_on_both_ports_under_every_policy(policy: str, monkeypatch: pytest.MonkeyPatch) \
        -> None:
    """ARCH-4: ``policy_state`` reads the policy's own fields without the port's snapshot (here it raises), both
    ports report the same after every step (by arrival: the implementations number their sequences apart), and
    that is what the policy keeps: each live request's priority, each waiting one's passes and the patience."""
    pair = [policy_port(name, policy) for name in IMPLEMENTATIONS]
    arrivals = [{s.seq_id: a for a, s in enumerate(sorted(port.waiting, key=lambda s: s.seq_id))} for port in pair]
    fields: set[str] = set()
    while not pair[0].is_finished():
        states = []
        for port, arrival in zip(pair, arrivals, strict=True):
            out = port.schedule()
            port.postprocess(out.batch, [1] * len(out.batch), out.is_prefill)
            with monkeypatch.context() as patch:
                patch.setattr(port, "snapshot", lambda: pytest.fail("policy_state took a snapshot"))
                state = port.policy_state()
            live = {arrival[s.seq_id] for s in (*port.waiting, *port.running)}
            waiting = {arrival[s.seq_id] for s in port.waiting}
            by_arrival = {k: {arrival[i]: v for i, v in val.items()} if isinstance(val, dict) else val
                          for k, val in state.items()}
            assert by_arrival["policy"] == policy
            if policy == "priority":
                assert by_arrival["priorities"] == {a: PRIORITIES[a] for a in live}
            if policy == "lpm":
                assert by_arrival["patience"] == 1 and set(by_arrival["passes"]) == waiting
            fields |= set(state)
            states.append(by_arrival)
        assert states[0] == states[1]
    assert fields == {"policy"} | {"priority": {"priorities"}, "lpm": {"passes", "patience"}}.get(policy, set())
