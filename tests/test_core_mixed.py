"""The optimized ``mixed`` policy decides every step as its reference (POLICY-13, OPT-1): the differential machine
under ``mixed``, the cases where the policy departs from the lesson compared step by step through the port, and
mutants of the policy that these tests tell apart."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from invariants import check_batch, seq_view
from optimized.cli.conformance import policy_snapshot, step_violations
from optimized.core.config import SchedulerConfig
from optimized.core.errors import EmptyDecodeError
from optimized.core.mixed_scheduler import MixedScheduler
from optimized.core.policies import make_scheduler
from optimized.core.port import PortFactory, ScheduleOutput, SchedulerPort
from optimized.core.sequence import Sequence
from optimized.verify.conformance import Workload, implementation, parse_workload, replay
from optimized.verify.machines import Stats, counting
from optimized.verify.machines.differential_machine import Disagreement
from optimized.verify.machines.policy_machines import MixedDifferential
from optimized.verify.reference_port import ReferencePort
from tests.optimized_pair import SAMPLES

pytestmark = pytest.mark.clause("POLICY-13", "OPT-1")


@pytest.mark.clause("POLICY-2", "POLICY-14")
def test_the_conformance_command_checks_a_mixed_step_by_the_mixed_clauses() -> None:
    """POLICY-14: the command's check after schedule() (``step_violations``) reads a mixed step by the mixed
    clauses: a real mixed step passes, one over its budget or with its flag denied is reported."""
    port = ReferencePort(mixed_config(num_blocks=30, block_size=2, max_num_seqs=5, max_num_batched_tokens=8))
    port.add(port.new_sequence([1, 2, 3], 5))
    out = port.schedule()
    port.postprocess(out.batch, [1], out.is_prefill)
    port.add(port.new_sequence([9] * 9, 5))
    out = port.schedule()
    state, views = policy_snapshot(port), [seq_view(s) for s in out.batch]
    assert state.policy == "mixed" and [v.is_prefill for v in views] == [False, True]
    assert step_violations(state, views, True) == []
    over = dataclasses.replace(state, max_num_batched_tokens=7)
    assert {"INV-12", "POLICY-3"} <= {v.clause for v in step_violations(over, views, True)}
    assert [v.clause for v in step_violations(state, views, False)] == ["POLICY-2"]


# --- the differential machine under mixed -------------------------------------------------------------------------
@dataclass
class Reach:
    """What a machine run under ``mixed`` reached beyond what ``Stats`` counts (by the reference's batches)."""

    mixed_steps: int = 0  # steps with decodes and prefills together
    cut_short: int = 0  # prefills cut short by the budget
    chunks_dropped: int = 0  # a prefill cut short that lost its blocks to a decode
    empty_decodes: int = 0
    preemptions: int = 0  # the lockstep driver's (the machine counts its own in Stats)


class CountedMixed(MixedDifferential):
    """The machine under ``mixed``, counting what it reached into ``reach``."""

    reach: Reach | None = None  # a test that counts gives its subclass one

    def schedule_both(self) -> tuple[list[Any], list[Any], bool] | None:
        assert self.ref is not None
        front = self.ref.waiting[0] if self.ref.waiting and self.ref.waiting[0].block_table else None
        out = super().schedule_both()
        reach = self.reach
        if reach is None:
            return out
        if front is not None and not front.block_table and any(s is front for s in self.ref.waiting):
            reach.chunks_dropped += 1
        if out is None:
            reach.empty_decodes += 1
            return None
        batch, is_prefill = out[0], out[2]
        reach.mixed_steps += is_prefill and not batch[0].is_prefill
        reach.cut_short += any(s.is_prefill and s.num_cached_tokens + s.num_scheduled_tokens < s.num_tokens
                               for s in batch)
        return out


TestMixedDifferential = MixedDifferential.TestCase  # under the suite's profile (tests/conftest.py)

SEARCH = settings(max_examples=60, stateful_step_count=30, derandomize=True, database=None, deadline=None,
                  phases=[Phase.generate])  # finding is the point; shrinking would only cost time


def test_the_machine_reaches_mixed_steps_chunks_and_preemptions() -> None:
    """POLICY-13: the machine under ``mixed`` reaches what the policy changes: steps holding decodes and prefills,
    prefills cut short, preemptions, the empty decode. (A cut-short prefill losing its blocks to a decode is rare
    in its draws, about once in a hundred runs: the targeted test below makes it happen.)"""
    stats, reach = Stats(), Reach()
    machine = type("Counted", (CountedMixed,), {"reach": reach})
    run_state_machine_as_test(counting(machine, stats), settings=SEARCH)
    assert stats.violations == 0
    assert stats.steps > 500 and stats.preemptions > 0 and stats.prefix_hit_tokens > 0 and stats.aborts > 0, stats
    assert reach.mixed_steps > 10 and reach.cut_short > 10 and reach.empty_decodes > 0, reach


# --- a lockstep pair, compared through the port -------------------------------------------------------------------
def mixed_config(**fields: int) -> SchedulerConfig:
    fields.setdefault("eos", -1)
    return SchedulerConfig(policy="mixed", **fields)


class Twin:
    """The mixed reference (through ReferencePort) and an optimized scheduler of ``mixed``, fed the same requests and
    tokens; after every call both agree on every decision and every state (``compare``)."""

    def __init__(self, config: SchedulerConfig, make: PortFactory = make_scheduler) -> None:
        self.ref = ReferencePort(config)
        self.opt = make(config)
        self.ref_seqs: list[Any] = []
        self.opt_seqs: list[Any] = []
        self.outputs: list[ScheduleOutput[Any]] = []

    def add(self, prompt: list[int], max_tokens: int, ignore_eos: bool = True, stops: frozenset[int] = frozenset(),
            ) -> int:
        r, o = self.ref.new_sequence(prompt, max_tokens, ignore_eos), self.opt.new_sequence(prompt, max_tokens,
                                                                                            ignore_eos)
        self.ref.add(r, stops)
        self.opt.add(o, stops)
        self.ref_seqs.append(r)
        self.opt_seqs.append(o)
        return len(self.ref_seqs) - 1

    def ids(self, seqs: Any, mine: list[Any]) -> list[int]:
        return [next(i for i, m in enumerate(mine) if m is s) for s in seqs]

    def schedule(self) -> tuple[ScheduleOutput[Any], ScheduleOutput[Any]] | None:
        """schedule() on both; None when both raised EmptyDecodeError (anything else there is a disagreement)."""
        errors: list[bool] = []
        outs: list[ScheduleOutput[Any]] = []
        for port in (self.ref, self.opt):
            try:
                outs.append(port.schedule())
                errors.append(False)
            except EmptyDecodeError:
                errors.append(True)
        assert errors[0] == errors[1], f"empty decode in one only: {errors}"
        self.compare()
        if errors[0]:
            return None
        ref_out, opt_out = outs
        assert self.report(ref_out, self.ref_seqs) == self.report(opt_out, self.opt_seqs)
        self.outputs.append(opt_out)
        return ref_out, opt_out

    def report(self, out: ScheduleOutput[Any], mine: list[Any]) -> tuple[Any, ...]:
        return (self.ids(out.batch, mine), out.is_prefill, [(s.num_scheduled_tokens, s.num_cached_tokens,
                s.is_prefill, list(s.block_table)) for s in out.batch], self.ids(out.preempted, mine),
                out.prefix_hit_tokens, out.prefix_query_tokens)

    def step(self, tokens: list[int] | None = None) -> ScheduleOutput[Any] | None:
        """One schedule()+postprocess() on both, compared; the optimized side's output (None at an empty decode)."""
        outs = self.schedule()
        if outs is None:
            return None
        self.postprocess(outs, tokens)
        return outs[1]

    def postprocess(self, outs: tuple[ScheduleOutput[Any], ScheduleOutput[Any]], tokens: list[int] | None = None,
                    copy: bool = False) -> list[int]:
        """postprocess() on both, of what schedule() returned (the optimized side a copy, with ``copy``), compared;
        who finished, by arrival index."""
        ref_out, opt_out = outs
        model = tokens if tokens is not None else [1 + (len(s) * 7) % 5 for s in ref_out.batch]
        finished = (self.ref.postprocess(ref_out.batch, model, ref_out.is_prefill),
                    self.opt.postprocess(list(opt_out.batch) if copy else opt_out.batch, model, opt_out.is_prefill))
        assert self.ids(finished[0], self.ref_seqs) == self.ids(finished[1], self.opt_seqs)
        self.compare()
        return self.ids(finished[1], self.opt_seqs)

    def compare(self) -> None:
        r, o = self.ref.snapshot(), self.opt.snapshot()
        assert (r.free_block_ids, r.used_block_ids, r.hash_to_block_id) == \
               (o.free_block_ids, o.used_block_ids, o.hash_to_block_id)
        assert [(x.ref_count, x.hash, x.token_ids) for x in r.blocks] == \
               [(x.ref_count, x.hash, x.token_ids) for x in o.blocks]
        for attr in ("waiting", "running"):
            assert self.ids(getattr(self.ref, attr), self.ref_seqs) == self.ids(getattr(self.opt, attr),
                                                                                  self.opt_seqs), attr
        for rs, os_ in zip(self.ref_seqs, self.opt_seqs, strict=True):
            assert dataclasses.replace(seq_view(rs), seq_id=-1) == dataclasses.replace(seq_view(os_), seq_id=-1)

    def drain(self, limit: int = 500) -> int:
        steps = 0
        while not self.ref.is_finished() and steps < limit:
            self.step()
            steps += 1
        assert self.ref.is_finished() and self.opt.is_finished()
        return steps


# --- the cases where mixed departs from the lesson ----------------------------------------------------------------
@pytest.mark.clause("POLICY-2")
def test_a_prefill_step_decodes_first_with_the_fields_the_model_runner_reads() -> None:
    """POLICY-2: decodes first; inside a prefill batch a decode computes its last token (cached = tokens - 1, one
    scheduled, is_prefill False), a prefill its chunk; the reference's to the block id."""
    twin = Twin(mixed_config(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=16))
    twin.add([11, 12, 13], 12)
    twin.add([14, 15, 16], 12)
    twin.step()
    twin.add(list(range(10, 50)), 2)
    outs = twin.schedule()
    assert outs is not None and outs[1].is_prefill
    decodes, chunk = outs[1].batch[:2], outs[1].batch[2]
    assert [(s.num_cached_tokens, s.num_scheduled_tokens, s.is_prefill) for s in decodes] == [(3, 1, False)] * 2
    assert (chunk.num_cached_tokens, chunk.num_scheduled_tokens, chunk.is_prefill) == (0, 14, True)
    twin.postprocess(outs)
    twin.drain()


def cut_short_case(make: PortFactory) -> None:
    """Two requests decode; a prompt of four blocks takes the four free ones and is cut short by the budget; the
    next step both decodes need a fresh block."""
    twin = Twin(mixed_config(num_blocks=8, block_size=2, max_num_seqs=4, max_num_batched_tokens=6), make)
    twin.add([1, 2, 3], 8)
    twin.add([4, 5, 6], 8)
    twin.step()  # both prefilled: two blocks each, four tokens
    long_prompt = twin.add(list(range(20, 28)), 2)
    dropped = admitted_after = 0
    for _ in range(40):
        front = twin.opt.waiting[0] if twin.opt.waiting else None
        held = bool(front is not None and front.block_table)
        out = twin.step()
        assert out is not None
        if held and front is not None and not front.block_table:
            dropped += 1
            assert twin.ids(twin.opt.waiting, twin.opt_seqs)[0] == long_prompt  # it keeps its place
            assert not out.is_prefill and out.preempted == ()  # its chunks were enough: nobody else went
            admitted_after += any(s.is_prefill for s in out.batch)
        if twin.ref.is_finished():
            break
    assert dropped > 0 and admitted_after == 0
    twin.drain()


@pytest.mark.clause("POLICY-3")
def test_the_prefill_cut_short_loses_its_blocks_first_and_the_step_admits_nothing() -> None:
    """POLICY-3: when a decode finds no free block, the prefill cut short at the front of waiting loses its blocks
    before any running request is preempted, keeps its place, and that step admits no prefill."""
    cut_short_case(make_scheduler)


def preempting_step_case(make: PortFactory) -> None:
    twin = Twin(mixed_config(num_blocks=5, block_size=4, max_num_seqs=4, max_num_batched_tokens=9), make)
    arrivals = [[], [([1, 2, 3, 4, 15, 16, 10, 11], 5), ([1, 2, 3, 4, 5, 6, 7, 8, 12, 10], 2)],
                [([1, 2, 3, 4, 10, 20], 4), ([1, 2, 3, 4, 11, 15, 14, 15], 6)],
                [([15], 6), ([1, 2, 3, 4, 5, 6, 7, 8, 12], 5)]]
    short_steps = 0
    for step_arrivals in arrivals:
        for prompt, max_tokens in step_arrivals:
            if len(prompt) + max_tokens <= 20:  # what the engine admits (ENG-10)
                twin.add(prompt, max_tokens, ignore_eos=False)
        if not twin.ref.is_finished():
            twin.step([5] * 8)
    while not twin.ref.is_finished():
        holding = {id(s): list(s.block_table) for s in twin.opt_seqs if s.block_table}
        outs = twin.schedule()
        assert outs is not None
        # A table only grows within schedule(), unless its blocks were let go.
        if any(id(s) in holding and s.block_table[: len(holding[id(s)])] != holding[id(s)] for s in twin.opt_seqs):
            short_steps += 1
            assert not outs[1].is_prefill and all(not s.is_prefill for s in outs[1].batch)
        twin.postprocess(outs, [5] * 8)
    assert short_steps > 0


@pytest.mark.clause("POLICY-3")
def test_a_step_that_preempted_admits_no_prefill() -> None:
    """POLICY-3: a partly prefilled request sharing prefix blocks with a running one loses its own blocks to a
    decode; it would fit again at once, yet the preempting step admits nothing (tests/test_policy_references.py's
    workload, here through both implementations)."""
    preempting_step_case(make_scheduler)


@pytest.mark.clause("OPT-9")
def test_the_empty_decode_raises_where_the_reference_asserts_and_leaves_its_state() -> None:
    """OPT-9 under mixed: a request that outgrows the cache alone preempts itself; the step has nothing to run and
    both raise EmptyDecodeError, leaving it at the front of waiting; the next steps agree too (it is taken in and
    let go again), as does an abort of it."""
    twin = Twin(mixed_config(num_blocks=2, block_size=2, max_num_seqs=2, max_num_batched_tokens=4))
    victim = twin.add([1, 2, 3], 5)  # needs three blocks at its fourth token's successor
    empties = 0
    for _ in range(6):
        if twin.step() is None:
            empties += 1
            assert twin.ids(twin.opt.waiting, twin.opt_seqs) == [victim] and not twin.opt.running
    assert empties >= 2
    twin.ref.abort(twin.ref_seqs[victim])
    twin.opt.abort(twin.opt_seqs[victim])
    twin.compare()
    assert twin.opt.is_finished()
    # With nothing waiting or running, schedule() is the reference's assert too.
    with pytest.raises(EmptyDecodeError):
        twin.opt.schedule()


def test_a_mixed_step_postprocessed_from_a_copy_of_its_batch_or_with_stop_tokens() -> None:
    """OPT-1: a mixed batch handed back as a copy, and stop tokens drawn by decodes and by a completing prefill in
    the same step, finish and release exactly as the reference."""
    twin = Twin(mixed_config(num_blocks=30, block_size=2, max_num_seqs=5, max_num_batched_tokens=8))
    twin.add([1, 2, 3], 6, stops=frozenset({4}))
    twin.add([1, 2, 5], 6)
    twin.step([1, 1])
    twin.add([1, 2, 3, 6, 7], 4, stops=frozenset({4}))
    twin.add(list(range(10, 22)), 3)
    outs = twin.schedule()
    assert outs is not None and outs[1].is_prefill and len(outs[1].batch) == 4
    # The first decode and the completing prefill draw their stop token; the batch comes back as a copy.
    assert twin.postprocess(outs, [4, 2, 4, 3], copy=True) == [0, 2]
    outs = twin.schedule()
    assert outs is not None and outs[1].is_prefill
    assert twin.postprocess(outs, [4] * len(outs[1].batch)) == []  # no stop set but the finished ones': nobody
    twin.drain()


def test_aborts_between_mixed_steps_and_a_failed_mixed_step() -> None:
    """spec/abort.md under mixed: a running request and the prefill cut short are aborted between steps, then a
    step holding decodes and a chunk fails and is withdrawn (abort_step); every later step still agrees."""
    twin = Twin(mixed_config(num_blocks=30, block_size=2, max_num_seqs=4, max_num_batched_tokens=6))
    for prompt in ([1, 2, 3], [1, 2, 4], [5, 6, 7]):
        twin.add(prompt, 6)
    twin.step()
    twin.step()
    twin.add(list(range(10, 25)), 3)  # cut short: three decodes leave three tokens of budget
    out = twin.step()
    assert out is not None and out.is_prefill
    cut = twin.opt_seqs[3]
    assert twin.opt.waiting[0] is cut and cut.block_table and 0 < cut.num_cached_tokens < cut.num_tokens
    for index in (1, 3):  # a running request, then the prefill cut short (holding blocks)
        twin.ref.abort(twin.ref_seqs[index])
        twin.opt.abort(twin.opt_seqs[index])
        twin.compare()
    twin.add(list(range(30, 40)), 2)
    outs = twin.schedule()
    assert outs is not None and outs[1].is_prefill and not outs[1].batch[0].is_prefill
    twin.ref.abort_step(outs[0].batch)
    twin.opt.abort_step(outs[1].batch)
    twin.compare()
    twin.add([1, 2, 3, 9], 3)
    twin.drain()


def test_the_snapshot_names_the_policy() -> None:
    scheduler = make_scheduler(mixed_config(num_blocks=4, block_size=2))
    assert isinstance(scheduler, MixedScheduler) and scheduler.snapshot().policy == "mixed"


def test_every_conformance_workload_replays_identically_under_mixed() -> None:
    """The shipped conformance workloads (the lesson's samples) with the policy set to mixed: the optimized replay's
    trace is the reference's, record for record (an empty decode included), and every step of both keeps the
    mixed batch clauses; some of their steps are mixed."""
    mixed_steps = 0

    def checked(port: SchedulerPort[Any], batch: list[Any], is_prefill: bool) -> None:
        nonlocal mixed_steps
        assert check_batch(port.snapshot(), [seq_view(s) for s in batch], is_prefill) == []
        mixed_steps += is_prefill and not batch[0].is_prefill

    empty = 0
    for sample in SAMPLES:
        workload = parse_workload(sample["workload"])
        workload = Workload({**workload.config, "policy": "mixed"}, workload.requests)
        trace = replay(workload, implementation("reference"), on_schedule=checked)
        assert replay(workload, implementation("optimized"), on_schedule=checked) == trace
        empty += trace[-1].get("error") == "empty decode"
    assert mixed_steps > 0 and empty > 0, (mixed_steps, empty)


# --- many small workloads under cache pressure, in lockstep ---------------------------------------------------------
Arrivals = list[list[tuple[list[int], int, bool]]]  # per step: (prompt, max_tokens, ignore_eos)


@st.composite
def pressured_workloads(draw: st.DrawFn) -> tuple[SchedulerConfig, Arrivals, list[int]]:
    """A small cache shared by requests with common prefixes, each fitting it alone (ENG-10), arriving over a few
    steps: decodes preempt, prefills are cut short and lose their chunks, and prefix hits let a request preempted
    or dropped fit again at once."""
    config = mixed_config(num_blocks=draw(st.integers(4, 24)), block_size=draw(st.sampled_from((2, 4))),
                          max_num_seqs=draw(st.integers(1, 6)), max_num_batched_tokens=draw(st.integers(2, 24)), eos=7)
    capacity = config.num_blocks * config.block_size
    prefixes = draw(st.lists(st.lists(st.integers(1, 3), max_size=12), min_size=1, max_size=3))
    steps: Arrivals = []
    for _ in range(draw(st.integers(1, 10))):
        arrivals = []
        for _ in range(draw(st.integers(0, 3))):
            prompt = (draw(st.sampled_from(prefixes)) + draw(st.lists(st.integers(1, 4), min_size=1, max_size=10)))
            prompt = prompt[: capacity - 1]
            arrivals.append((prompt, draw(st.integers(1, min(16, capacity - len(prompt)))), draw(st.booleans())))
        steps.append(arrivals)
    return config, steps, draw(st.lists(st.integers(1, 7), min_size=1, max_size=12))


def lockstep(make: PortFactory, workload: tuple[SchedulerConfig, Arrivals, list[int]], reach: Reach) -> None:
    """The workload through the mixed reference and ``make``'s scheduler, compared after every call."""
    config, steps, tokens = workload
    twin = Twin(config, make)
    draws = itertools.cycle(tokens)
    for step in itertools.chain(steps, itertools.repeat([], 2000)):
        for prompt, max_tokens, ignore_eos in step:
            twin.add(prompt, max_tokens, ignore_eos)
        if twin.ref.is_finished():
            if step or any(steps):
                steps = steps[1:]
                continue
            break
        front = twin.opt.waiting[0] if twin.opt.waiting and twin.opt.waiting[0].block_table else None
        outs = twin.schedule()
        assert outs is not None  # every request fits the cache alone: never an empty decode
        reach.chunks_dropped += front is not None and not front.block_table
        reach.mixed_steps += outs[1].is_prefill and not outs[1].batch[0].is_prefill
        reach.preemptions += len(outs[1].preempted)
        twin.postprocess(outs, [next(draws) for _ in outs[0].batch])
        steps = steps[1:]
    assert twin.ref.is_finished() and twin.opt.is_finished()


PRESSURE = settings(max_examples=150, deadline=None, derandomize=True, database=None)


def test_workloads_under_cache_pressure_decide_as_the_reference() -> None:
    """OPT-1 under mixed, where the machine's draws rarely go: every decision of every step is the reference's,
    over workloads that reach mixed steps, preemptions and cut-short prefills losing their chunks (counted)."""
    reach = Reach()

    @PRESSURE
    @given(pressured_workloads())
    def agree(workload: tuple[SchedulerConfig, Arrivals, list[int]]) -> None:
        lockstep(make_scheduler, workload, reach)

    agree()
    assert reach.mixed_steps > 100 and reach.preemptions > 0 and reach.chunks_dropped > 0, reach


# --- negative controls: mutants of the policy ---------------------------------------------------------------------
class AdmitsAfterPreempting(MixedScheduler):
    """The mutant: a step whose decodes found no free block still admits prefills."""

    def _decode_members(self) -> tuple[tuple[Sequence, ...], bool]:
        preempted, _ = super()._decode_members()
        return preempted, False


class PreemptsBeforeDroppingChunks(MixedScheduler):
    """The mutant: a decode short of a block preempts the newest running request before the prefill cut short."""

    def _release_before_preempting(self) -> bool:
        return False


@pytest.mark.parametrize(("mutant", "case"), [(AdmitsAfterPreempting, preempting_step_case),
                                              (PreemptsBeforeDroppingChunks, cut_short_case)])
def test_the_targeted_cases_tell_each_mutant_apart(mutant: PortFactory, case: Any) -> None:
    """The negative control: each mutant disagrees with the reference in its case above. (In the cut-short case
    admitting after the drop changes nothing: the blocks the drop frees are the ones the prefill needs again.)"""
    with pytest.raises(AssertionError):
        case(mutant)


@pytest.mark.parametrize("mutant", [AdmitsAfterPreempting, PreemptsBeforeDroppingChunks])
def test_the_workloads_under_pressure_find_each_mutant(mutant: PortFactory) -> None:
    """The negative control of the lockstep search: a workload it draws tells each mutant from the reference."""

    def disagrees(workload: tuple[SchedulerConfig, Arrivals, list[int]]) -> bool:
        try:
            lockstep(mutant, workload, Reach())
        except AssertionError:
            return True
        return False

    find(pressured_workloads(), disagrees, settings=settings(PRESSURE, max_examples=1000, phases=[Phase.generate]))


def test_the_machine_tells_apart_a_step_whose_decodes_do_not_count_against_the_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control of the machine: with the decodes left out of the step's budget (POLICY-2) in the
    optimized policy, its search reports a disagreement with the reference. (The machine does not reach the other
    mutants above in 400 runs: the targeted cases are their controls.)"""
    original = MixedScheduler._prefill_chunks

    def whole_budget(self: MixedScheduler, budget: int, seats: int) -> tuple[list[Sequence], int, int]:
        return original(self, self.max_num_batched_tokens, seats)

    monkeypatch.setattr(MixedScheduler, "_prefill_chunks", whole_budget)
    with pytest.raises(Disagreement, match="OPT-1"):
        run_state_machine_as_test(counting(MixedDifferential, Stats()), settings=SEARCH)
