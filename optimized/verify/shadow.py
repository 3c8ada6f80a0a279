"""Check mode: the reference scheduler runs in lockstep with the engine's and must decide the same.

The shadow mirrors every add (same tokens, same max_tokens/ignore_eos, same
scheduler config) and is fed the engine's tokens, so both schedulers see the
same history. After each schedule() it compares the batch (arrival ids in
order), each sequence's granted tokens and block table, prefill-or-decode, and
the preempted arrivals; after postprocess() the finished arrivals. Every
invariant of ``invariants`` is checked on both schedulers at both points. An
abort, or a failed step's batch (spec/abort.md, beyond the lesson), is applied
to the reference with ``reference.extensions`` and the free queues (which
hold the release order) must then be equal. The first difference or violation
raises ``ShadowDivergence`` with both states dumped. Sequences are matched by arrival order, never by seq_id: the two
implementations number their sequences independently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import reference
from invariants import SchedulerState, check_batch, check_state, seq_view, snapshot
from optimized.engine.sampling_params import SamplingParams
from reference.extensions import abort, abort_step, postprocess_with_stops


def schedule_reporting_preemptions(
    ref: reference.Scheduler,
) -> tuple[list[reference.Sequence], bool, list[reference.Sequence]]:
    """The reference's ``schedule()`` (the lesson's signature, kept) and whom it preempted.

    Only a decode step preempts, and only running sequences: those sent back to waiting, always the
    queue's tail first, so the preemption order is the reverse of their running order. This adapter reads
    that off the reference's queues, to be compared with ``ScheduleOutput.preempted`` (OPT-22).
    """
    running_before = list(ref.running)
    batch, is_prefill = ref.schedule()
    preempted = [s for s in reversed(running_before) if s.status is reference.SequenceStatus.WAITING]
    return batch, is_prefill, preempted


class ShadowDivergence(RuntimeError):
    """The engine's scheduler and the reference decided differently, or one broke an invariant."""


class SchedulerKnobs(Protocol):
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def eos(self) -> int: ...


class Arrived(Protocol):
    """What the shadow reads of an engine request."""

    arrival: int
    seq: Any


def _arrivals(live: Mapping[int, Arrived]) -> dict[int, int]:
    """Live requests' arrivals by the engine's seq_id."""
    return {seq_id: r.arrival for seq_id, r in live.items()}


def _dump(state: SchedulerState) -> str:
    def seqs(views: list[Any]) -> str:
        return "\n".join(
            f"    id={v.seq_id} {v.status} len={v.num_tokens} prompt={v.num_prompt_tokens} "
            f"cached={v.num_cached_tokens} sched={v.num_scheduled_tokens} blocks={v.block_table}"
            for v in views
        )

    free = state.free_block_ids
    return (
        f"  free blocks ({len(free)}): {free[:16]}{' ...' if len(free) > 16 else ''}\n"
        f"  waiting:\n{seqs(state.waiting)}\n  running:\n{seqs(state.running)}"
    )


class Shadow:
    """Check mode as the engine's ``StepObserver`` (ARCH-3): every hook mirrors the change on the reference."""

    def __init__(self, config: SchedulerKnobs, stats: Any = None) -> None:
        self.ref = reference.Scheduler(
            reference.SchedulerConfig(
                num_blocks=config.num_blocks,
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                eos=config.eos,
            )
        )
        self.block_size = config.block_size
        self.by_arrival: dict[int, reference.Sequence] = {}
        self.arrival_of: dict[int, int] = {}  # reference seq_id -> arrival
        self.stops: dict[int, frozenset[int]] = {}  # reference seq_id -> stop set (ENG-12)
        self.batch: list[reference.Sequence] = []
        self.is_prefill = True
        self.step = 0
        self.stats = stats  # the engine's EngineStats: ``compared_steps`` counts the steps compared

    # --- the engine's StepObserver hooks ----------------------------------------------------------------
    def before_change(self) -> None:
        """The shadow refuses nothing."""

    def check_add(self, token_ids: Sequence[int], params: Any) -> None:
        """The reference takes whatever the engine validated."""

    def added(self, request: Any) -> None:
        self.add(request.arrival, request.seq.token_ids, request.params, request.stop_ids)

    def scheduled(self, scheduler: Any, out: Any, requests: Sequence[Arrived], live: Mapping[int, Arrived]) -> None:
        self.after_schedule(scheduler, requests, out.is_prefill, [live[s.seq_id].arrival for s in out.preempted])

    def stepped(self, scheduler: Any, tokens: Any, finished: Sequence[Arrived], start: float) -> None:
        self.after_postprocess(scheduler, tokens, [r.arrival for r in finished])
        if self.stats is not None:
            self.stats.compared_steps += 1

    def step_failed(self, fault: BaseException, start: float) -> None:
        """Mirrored once the batch is withdrawn (``batch_withdrawn``)."""

    def batch_withdrawn(self, scheduler: Any, failed: Sequence[Arrived], live: Mapping[int, Arrived]) -> None:
        self.fail_step(scheduler, [r.arrival for r in failed], _arrivals(live))

    def aborted(self, scheduler: Any, request: Arrived, live: Mapping[int, Arrived]) -> None:
        self.abort(scheduler, request.arrival, _arrivals(live))

    def close(self) -> None:
        """Nothing kept."""

    # --- the comparisons ----------------------------------------------------------------------------------
    def add(self, arrival: int, token_ids: Sequence[int], params: SamplingParams, stops: frozenset[int]) -> None:
        """The same request; ``stops`` its stop set, which the reference honours through the extension rule."""
        rp = reference.SamplingParams(params.temperature, params.max_tokens, params.ignore_eos)
        seq = reference.Sequence(list(token_ids), rp, self.block_size)
        self.by_arrival[arrival] = seq
        self.arrival_of[seq.seq_id] = arrival
        self.stops[seq.seq_id] = stops
        self.ref.add(seq)

    def _fail(self, engine_scheduler: Any, what: str) -> None:
        raise ShadowDivergence(
            f"check mode, step {self.step}: {what}\n"
            f"--- engine scheduler ---\n{_dump(snapshot(engine_scheduler))}\n"
            f"--- reference scheduler ---\n{_dump(snapshot(self.ref))}"
        )

    def _check(self, engine_scheduler: Any, batch: list[Any] | None = None) -> None:
        """Invariants on both schedulers: with ``batch`` right after schedule(), without it between steps."""
        between_steps = batch is None
        ref_batch = None if batch is None else self.batch
        for name, sched, seqs in (("engine", engine_scheduler, batch), ("reference", self.ref, ref_batch)):
            state = snapshot(sched)
            violations = check_state(state, between_steps=between_steps)
            if seqs is not None:
                violations += check_batch(state, [seq_view(s) for s in seqs], self.is_prefill)
            if violations:
                self._fail(engine_scheduler, f"{name} scheduler breaks " + "; ".join(map(str, violations)))

    def after_schedule(
        self, engine_scheduler: Any, batch: Sequence[Arrived], is_prefill: bool, preempted: list[int]
    ) -> None:
        self.batch, self.is_prefill, preempted_seqs = schedule_reporting_preemptions(self.ref)
        ref_preempted = [self.arrival_of[s.seq_id] for s in preempted_seqs]
        mine = [(r.arrival, r.seq.num_scheduled_tokens, list(r.seq.block_table)) for r in batch]
        ref = [(self.arrival_of[s.seq_id], s.num_scheduled_tokens, list(s.block_table)) for s in self.batch]
        if is_prefill != self.is_prefill:
            self._fail(engine_scheduler, f"is_prefill engine={is_prefill} reference={self.is_prefill}")
        if mine != ref:
            self._fail(engine_scheduler, f"batch (arrival, tokens, blocks) engine={mine} reference={ref}")
        if sorted(preempted) != sorted(ref_preempted):
            self._fail(engine_scheduler, f"preempted arrivals engine={preempted} reference={ref_preempted}")
        self._check(engine_scheduler, [r.seq for r in batch])

    def after_postprocess(self, engine_scheduler: Any, tokens: list[int], finished: list[int]) -> None:
        stops = [self.stops[s.seq_id] for s in self.batch]
        postprocess_with_stops(self.ref, self.batch, tokens, self.is_prefill, stops)  # ENG-12 beside EOS
        ref_finished = [self.arrival_of[s.seq_id] for s in self.batch if s.status == reference.SequenceStatus.FINISHED]
        if sorted(finished) != sorted(ref_finished):
            self._fail(engine_scheduler, f"finished arrivals engine={finished} reference={ref_finished}")
        for a in ref_finished:
            self._forget(a)
        self.batch = []
        self._check(engine_scheduler)
        self.step += 1

    def abort(self, engine_scheduler: Any, arrival: int, engine_arrivals: dict[int, int]) -> None:
        """ABORT-8: the engine aborted this live arrival between steps; the reference aborts it too.

        ``engine_arrivals`` maps the engine's live seq ids to arrivals.
        """
        seq = self._forget(arrival)
        abort(self.ref, seq)
        self._compare_release(engine_scheduler, engine_arrivals, f"abort of arrival {arrival}")
        self._check(engine_scheduler)

    def fail_step(self, engine_scheduler: Any, failed: list[int], engine_arrivals: dict[int, int]) -> None:
        """FAULT-2: the engine's step failed after schedule(); the reference fails the same batch."""
        mine = [self.arrival_of[s.seq_id] for s in self.batch]
        if failed != mine:
            self._fail(engine_scheduler, f"failed batch engine={failed} reference={mine}")
        abort_step(self.ref, self.batch)
        for a in mine:
            self._forget(a)
        self.batch = []
        self._compare_release(engine_scheduler, engine_arrivals, f"failed step {mine}")
        self._check(engine_scheduler)
        self.step += 1

    def _forget(self, arrival: int) -> reference.Sequence:
        """A request finished or was aborted: drop it from the maps."""
        seq = self.by_arrival.pop(arrival)
        del self.arrival_of[seq.seq_id]
        del self.stops[seq.seq_id]
        return seq

    def _compare_release(self, engine_scheduler: Any, engine_arrivals: dict[int, int], what: str) -> None:
        """The same queues, by arrival, and the same free queue: block ids agree by construction (every table was
        compared when scheduled), so equal free queues mean the same blocks released in the same order."""
        for name in ("waiting", "running"):
            mine = [engine_arrivals[s.seq_id] for s in getattr(engine_scheduler, name)]
            ref = [self.arrival_of[s.seq_id] for s in getattr(self.ref, name)]
            if mine != ref:
                self._fail(engine_scheduler, f"{name} after {what}: engine={mine} reference={ref}")
        mine_free, ref_free = snapshot(engine_scheduler).free_block_ids, snapshot(self.ref).free_block_ids
        if mine_free != ref_free:
            self._fail(engine_scheduler, f"free queue after {what}: engine={mine_free} reference={ref_free}")
