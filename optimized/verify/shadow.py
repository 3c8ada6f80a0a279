"""Check mode: the reference scheduler runs in lockstep with the engine's and must decide the same.

The shadow mirrors every add (same tokens, same max_tokens/ignore_eos, same
stop set, same scheduler config) and is fed the engine's tokens, so both
schedulers see the same history. Both are driven through the scheduler port
(ARCH-4): the reference through its adapter (``reference_port``), whose
``schedule()`` reports whom it preempted and whose ``postprocess`` whom it
finished, as the engine's does. After each schedule() it compares the batch
(arrival ids in order), each sequence's granted tokens and block table,
prefill-or-decode, and the preempted arrivals; after postprocess() the
finished arrivals. Every invariant of ``invariants`` is checked on both
schedulers at both points. An abort, or a failed step's batch (spec/abort.md,
beyond the lesson), is applied to the reference through the port, and the
free queues (which hold the release order) must then be equal. The first
difference or violation raises ``ShadowDivergence`` with both states dumped.
Sequences are matched by arrival order, never by seq_id: the two
implementations number their sequences independently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NoReturn, Protocol

from invariants import SchedulerState, check_batch, check_state, seq_view
from optimized.core.config import SchedulerConfig
from optimized.core.port import EmptyDecodeError, ScheduleOutput, SchedulerPort, SeqLike
from optimized.engine.sampling_params import SamplingParams
from optimized.verify.reference_port import ReferencePort


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
        self.ref: SchedulerPort[Any] = ReferencePort(SchedulerConfig(
            num_blocks=config.num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, eos=config.eos))
        self.by_arrival: dict[int, SeqLike] = {}
        self.arrival_of: dict[int, int] = {}  # reference seq_id -> arrival
        self.batch: list[Any] = []
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

    def scheduled(self, scheduler: SchedulerPort[Any], out: ScheduleOutput[Any], requests: Sequence[Arrived],
                  live: Mapping[int, Arrived]) -> None:
        self.after_schedule(scheduler, requests, out.is_prefill, [live[s.seq_id].arrival for s in out.preempted])

    def stepped(self, scheduler: SchedulerPort[Any], tokens: Any, finished: Sequence[Arrived], start: float) -> None:
        self.after_postprocess(scheduler, tokens, [r.arrival for r in finished])
        if self.stats is not None:
            self.stats.compared_steps += 1

    def step_failed(self, fault: BaseException, start: float) -> None:
        """Mirrored once the batch is withdrawn (``batch_withdrawn``)."""

    def batch_withdrawn(self, scheduler: SchedulerPort[Any], failed: Sequence[Arrived],
                        live: Mapping[int, Arrived]) -> None:
        self.fail_step(scheduler, [r.arrival for r in failed], _arrivals(live))

    def aborted(self, scheduler: SchedulerPort[Any], request: Arrived, live: Mapping[int, Arrived]) -> None:
        self.abort(scheduler, request.arrival, _arrivals(live))

    def close(self) -> None:
        """Nothing kept."""

    # --- the comparisons ----------------------------------------------------------------------------------
    def add(self, arrival: int, token_ids: Sequence[int], params: SamplingParams, stops: frozenset[int]) -> None:
        """The same request; ``stops`` its stop set (ENG-12), which the reference honours through the port."""
        seq = self.ref.new_sequence(list(token_ids), params.max_tokens, params.ignore_eos, params.temperature)
        self.by_arrival[arrival] = seq
        self.arrival_of[seq.seq_id] = arrival
        self.ref.add(seq, stops)

    def _fail(self, engine_scheduler: SchedulerPort[Any], what: str) -> NoReturn:
        raise ShadowDivergence(
            f"check mode, step {self.step}: {what}\n"
            f"--- engine scheduler ---\n{_dump(engine_scheduler.snapshot())}\n"
            f"--- reference scheduler ---\n{_dump(self.ref.snapshot())}"
        )

    def _check(self, engine_scheduler: SchedulerPort[Any], batch: list[Any] | None = None) -> None:
        """Invariants on both schedulers: with ``batch`` right after schedule(), without it between steps."""
        between_steps = batch is None
        ref_batch = None if batch is None else self.batch
        ports: tuple[tuple[str, SchedulerPort[Any], list[Any] | None], ...] = (
            ("engine", engine_scheduler, batch), ("reference", self.ref, ref_batch))
        for name, port, seqs in ports:
            state = port.snapshot()
            violations = check_state(state, between_steps=between_steps)
            if seqs is not None:
                violations += check_batch(state, [seq_view(s) for s in seqs], self.is_prefill)
            if violations:
                self._fail(engine_scheduler, f"{name} scheduler breaks " + "; ".join(map(str, violations)))

    def after_schedule(
        self, engine_scheduler: SchedulerPort[Any], batch: Sequence[Arrived], is_prefill: bool, preempted: list[int]
    ) -> None:
        try:
            out = self.ref.schedule()
        except EmptyDecodeError:
            self._fail(engine_scheduler, "the reference hit the empty decode (EDGE-2), the engine scheduled a batch")
        self.batch, self.is_prefill = out.batch, out.is_prefill
        ref_preempted = [self.arrival_of[s.seq_id] for s in out.preempted]
        mine = [(r.arrival, r.seq.num_scheduled_tokens, list(r.seq.block_table)) for r in batch]
        ref = [(self.arrival_of[s.seq_id], s.num_scheduled_tokens, list(s.block_table)) for s in self.batch]
        if is_prefill != self.is_prefill:
            self._fail(engine_scheduler, f"is_prefill engine={is_prefill} reference={self.is_prefill}")
        if mine != ref:
            self._fail(engine_scheduler, f"batch (arrival, tokens, blocks) engine={mine} reference={ref}")
        if sorted(preempted) != sorted(ref_preempted):
            self._fail(engine_scheduler, f"preempted arrivals engine={preempted} reference={ref_preempted}")
        self._check(engine_scheduler, [r.seq for r in batch])

    def after_postprocess(self, engine_scheduler: SchedulerPort[Any], tokens: list[int], finished: list[int]) -> None:
        done = self.ref.postprocess(self.batch, tokens, self.is_prefill)  # the stop sets too (ENG-12)
        ref_finished = [self.arrival_of[s.seq_id] for s in done]
        if sorted(finished) != sorted(ref_finished):
            self._fail(engine_scheduler, f"finished arrivals engine={finished} reference={ref_finished}")
        for a in ref_finished:
            self._forget(a)
        self.batch = []
        self._check(engine_scheduler)
        self.step += 1

    def abort(self, engine_scheduler: SchedulerPort[Any], arrival: int, engine_arrivals: dict[int, int]) -> None:
        """ABORT-8: the engine aborted this live arrival between steps; the reference aborts it too.

        ``engine_arrivals`` maps the engine's live seq ids to arrivals.
        """
        seq = self._forget(arrival)
        self.ref.abort(seq)
        self._compare_release(engine_scheduler, engine_arrivals, f"abort of arrival {arrival}")
        self._check(engine_scheduler)

    def fail_step(self, engine_scheduler: SchedulerPort[Any], failed: list[int],
                  engine_arrivals: dict[int, int]) -> None:
        """FAULT-2: the engine's step failed after schedule(); the reference fails the same batch."""
        mine = [self.arrival_of[s.seq_id] for s in self.batch]
        if failed != mine:
            self._fail(engine_scheduler, f"failed batch engine={failed} reference={mine}")
        self.ref.abort_step(self.batch)
        for a in mine:
            self._forget(a)
        self.batch = []
        self._compare_release(engine_scheduler, engine_arrivals, f"failed step {mine}")
        self._check(engine_scheduler)
        self.step += 1

    def _forget(self, arrival: int) -> SeqLike:
        """A request finished or was aborted: drop it from the maps."""
        seq = self.by_arrival.pop(arrival)
        del self.arrival_of[seq.seq_id]
        return seq

    def _compare_release(self, engine_scheduler: SchedulerPort[Any], engine_arrivals: dict[int, int],
                         what: str) -> None:
        """The same queues, by arrival, and the same free queue: block ids agree by construction (every table was
        compared when scheduled), so equal free queues mean the same blocks released in the same order."""
        queues = (("waiting", engine_scheduler.waiting, self.ref.waiting),
                  ("running", engine_scheduler.running, self.ref.running))
        for name, engine_queue, ref_queue in queues:
            mine = [engine_arrivals[s.seq_id] for s in engine_queue]
            ref = [self.arrival_of[s.seq_id] for s in ref_queue]
            if mine != ref:
                self._fail(engine_scheduler, f"{name} after {what}: engine={mine} reference={ref}")
        mine_free, ref_free = engine_scheduler.snapshot().free_block_ids, self.ref.snapshot().free_block_ids
        if mine_free != ref_free:
            self._fail(engine_scheduler, f"free queue after {what}: engine={mine_free} reference={ref_free}")
