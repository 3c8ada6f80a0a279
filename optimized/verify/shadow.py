"""Check mode: the reference scheduler runs in lockstep with the engine's and must decide the same (spec/check.md).

The shadow mirrors every add (same tokens, same max_tokens/ignore_eos, same
stop set, same priority, same scheduler config, its policy and patience
included) and is fed the engine's tokens, so both
schedulers see the same history. Both are driven through the scheduler port
(ARCH-4): the reference through its adapter (``reference_port``).

Every step costs what the step holds, not what the cache holds (CHECK-1, 2):
after each schedule() it compares what the step decided (the batch by arrival,
each sequence's granted, cached and total tokens and block table,
prefill-or-decode, the preempted arrivals, the prefix-cache hit and query
tokens) and after postprocess() the finished arrivals; at both points it checks,
on both schedulers, the invariants that read no block (``check_live``), the
batch invariants (blocks read on demand) and the one-block invariants over the
blocks the step touched (taken, filled, hashed or released: derived from the
batch's block tables before and after, the tokens each member was granted, and
the tables of the sequences it preempted or finished), which must also read the
same on both, with the same number of free blocks. Every ``full_every`` steps,
when nothing is left live, after a failed step and at close of a trusted
engine, it compares the whole states and runs every invariant on both
(CHECK-3). The policy's own clauses (spec/policies.md) are among the invariants:
the engine's priorities are those its requests were added with; the lpm
counts, which the engine keeps to itself, are read from its ``policy_state`` at each
full comparison and must equal the reference's by arrival. An abort, or a
failed step's batch (spec/abort.md), is applied to the reference through the
port; the queues must then be equal by arrival, and the
released blocks read the same. The first difference or violation raises
``ShadowDivergence`` naming the step, with both states dumped. Sequences are
matched by arrival order, never by seq_id: the two implementations number their
sequences independently.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn, Protocol

from invariants import BlockView, SchedulerState, check_batch, check_live, check_state, seq_view
from invariants.on_demand import check_blocks, held_counts, light_state, live_view
from optimized.core.config import DEFAULT_PATIENCE, SchedulerConfig
from optimized.core.errors import strict_int
from optimized.core.port import EmptyDecodeError, ScheduleOutput, SchedulerPort, SeqLike
from optimized.engine.sampling_params import SamplingParams
from optimized.verify.reference_port import ReferencePort

# Every 32nd step (and at the ends CHECK-3 names) compares the whole states: measured by ``nanoverify bench check``
# (spec/check.md, CHECK-5), where the full comparison of an 8,192-block cache costs about as much as one step.
FULL_EVERY = 32


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
    # and, when it has them, ``policy`` and ``patience`` (a config without them is the lesson's)


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


def _decision(arrival: int, seq: SeqLike) -> tuple[int, int, int, int, list[int]]:
    """What a step decided for one batch member: its arrival, granted, cached and total tokens, block table."""
    return arrival, seq.num_scheduled_tokens, seq.num_cached_tokens, seq.num_tokens, list(seq.block_table)


def _touched_by_growth(old: list[int] | None, table: list[int]) -> list[int]:
    """The blocks a table's growth touched: its old last block (filled, maybe hashed) and every block after it;
    every block when the table is new or is not its old one extended (the batch comparison judges that)."""
    if old and table[: len(old)] == old:
        return table[len(old) - 1:]
    return table


def _filled(table: list[int], cached: int, granted: int, block_size: int) -> list[int]:
    """The blocks a postprocess touched for one batch member: every block its granted tokens went into (each
    that filled is hashed, as the reference's ``hash_blocks`` does), and its table's last block."""
    filled = table[cached // block_size : -(-(cached + granted) // block_size)]
    return [*filled, table[-1]] if table else filled


class _FullState:
    """One side's whole state, read through the port's ``BlockReader``: its columns (reference count, hash, tokens
    per block) and block views are kept between full comparisons, and a block's tokens and view replaced only where
    the block changed, so that a comparison leaves behind objects in proportion to what changed, not to
    ``num_blocks`` (thousands of new lists kept at each would wake the garbage collector's full pass)."""

    def __init__(self) -> None:
        self.columns: tuple[list[int], list[int], list[list[int]]] = ([], [], [])
        self.views: list[BlockView] = []

    def read(self, port: SchedulerPort[Any]) -> SchedulerState:
        blocks = port.blocks
        ids = range(blocks.num_blocks)
        ref_count, block_hash, is_used = blocks.ref_count, blocks.block_hash, blocks.is_used
        self._refresh(blocks, [ref_count(b) for b in ids], [block_hash(b) for b in ids])
        config = port.config
        return SchedulerState(
            block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, blocks=self.views,
            free_block_ids=blocks.free_block_ids, used_block_ids={b for b in ids if is_used(b)},
            hash_to_block_id=blocks.hash_to_block_id, waiting=[seq_view(s) for s in port.waiting],
            running=[seq_view(s) for s in port.running])

    def _refresh(self, blocks: Any, refs: list[int], hashes: list[int]) -> None:
        token_ids_of = blocks.token_ids_of
        old_refs, old_hashes, tokens = self.columns
        if len(refs) != len(self.views):
            tokens = [token_ids_of(b) for b in range(len(refs))]
            self.views = [BlockView(b, r, h, t) for b, (r, h, t) in enumerate(zip(refs, hashes, tokens, strict=True))]
        else:
            views = self.views
            for b in range(len(refs)):
                read = token_ids_of(b)
                if read != tokens[b] or refs[b] != old_refs[b] or hashes[b] != old_hashes[b]:
                    tokens[b] = read
                    views[b] = BlockView(b, refs[b], hashes[b], read)
        self.columns = refs, hashes, tokens


class Shadow:
    """Check mode as the engine's ``StepObserver`` (ARCH-3): every hook mirrors the change on the reference.

    ``full_every``: the whole states are compared every this many steps (``EngineArgs.check_full_every``), besides
    the ends CHECK-3 names; 1 compares them after every step.
    """

    def __init__(self, config: SchedulerKnobs, stats: Any = None, full_every: int = FULL_EVERY) -> None:
        self.full_every = strict_int(full_every, "check_full_every", 1)
        self.config = SchedulerConfig(
            num_blocks=config.num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, eos=config.eos,
            policy=getattr(config, "policy", "lesson"), patience=getattr(config, "patience", DEFAULT_PATIENCE))
        self.reference = ReferencePort(self.config)
        self.ref: SchedulerPort[Any] = self.reference
        self._priority: dict[int, int] = {}  # arrival -> its priority (the priority policy's; 0 under the others)
        self._engine_ids: dict[int, int] = {}  # arrival -> the engine's seq_id, for requests added through a hook
        self.by_arrival: dict[int, SeqLike] = {}
        self.arrival_of: dict[int, int] = {}  # reference seq_id -> arrival
        self.batch: list[Any] = []
        self.is_prefill = True
        self.step = 0
        self.stats = stats  # the engine's EngineStats: ``compared_steps`` counts the steps compared
        self.full_comparisons = 0  # whole-state comparisons made (CHECK-3)
        self._tables: dict[int, list[int]] = {}  # arrival -> its block table when last in a batch (CHECK-2)
        self._grants: list[tuple[int, int, int]] = []  # the batch's (arrival, tokens cached, tokens granted)
        self._touched: set[int] = set()  # blocks the step in progress touched
        self._changed = False  # anything changed since the last full comparison
        self._sound = True  # no comparison failed and no hook was interrupted: close() may compare
        self._engine: SchedulerPort[Any] | None = None
        self._live: Mapping[int, Arrived] = {}
        self._full = (_FullState(), _FullState())

    # --- the engine's StepObserver hooks ----------------------------------------------------------------
    def before_change(self) -> None:
        """The shadow refuses nothing."""

    def check_add(self, token_ids: Sequence[int], params: Any) -> None:
        """The reference takes whatever the engine validated."""

    def added(self, request: Any) -> None:
        self._engine_ids[request.arrival] = request.seq.seq_id
        self.add(request.arrival, request.seq.token_ids, request.params, request.stop_ids,
                 request.priority)

    def scheduled(self, scheduler: SchedulerPort[Any], out: ScheduleOutput[Any], requests: Sequence[Arrived],
                  live: Mapping[int, Arrived]) -> None:
        self._live = live
        self.after_schedule(scheduler, requests, out.is_prefill, [live[s.seq_id].arrival for s in out.preempted],
                            (out.prefix_hit_tokens, out.prefix_query_tokens))

    def stepped(self, scheduler: SchedulerPort[Any], tokens: Any, finished: Sequence[Arrived], start: float) -> None:
        self.after_postprocess(scheduler, tokens, [r.arrival for r in finished])
        if self.stats is not None:
            self.stats.compared_steps += 1

    def step_failed(self, fault: BaseException, start: float) -> None:
        """Mirrored once the batch is withdrawn (``batch_withdrawn``)."""

    def batch_withdrawn(self, scheduler: SchedulerPort[Any], failed: Sequence[Arrived],
                        live: Mapping[int, Arrived]) -> None:
        self._live = live
        self.fail_step(scheduler, [r.arrival for r in failed], _arrivals(live))

    def aborted(self, scheduler: SchedulerPort[Any], request: Arrived, live: Mapping[int, Arrived]) -> None:
        self._live = live
        self.abort(scheduler, request.arrival, _arrivals(live))

    def close(self, trusted: bool = True) -> None:
        """CHECK-3: the whole states once more, if anything changed since they were last compared, no comparison
        failed or was interrupted and the engine is ``trusted`` (no change of its state left half done, ENG-11:
        the reference would be part of a step behind). While another exception propagates, a divergence is
        noted on it instead of raised, so that it never hides that exception."""
        if self._engine is None or not (self._changed and self._sound and trusted):
            return
        propagating = sys.exc_info()[1]
        try:
            self._compare_full(self._engine, "at close")
        except ShadowDivergence as divergence:
            if propagating is None:
                raise
            propagating.add_note(f"check mode at close, while this propagated: {divergence}")

    # --- the comparisons ----------------------------------------------------------------------------------
    def add(self, arrival: int, token_ids: Sequence[int], params: SamplingParams, stops: frozenset[int],
            priority: int = 0) -> None:
        """The same request; ``stops`` its stop set (ENG-15), which the reference honours through the port, and
        ``priority`` its priority (POLICY-12)."""
        seq = self.ref.new_sequence(list(token_ids), params.max_tokens, params.ignore_eos, params.temperature)
        self.ref.add(seq, stops, priority)
        self.by_arrival[arrival] = seq
        self.arrival_of[seq.seq_id] = arrival
        self._priority[arrival] = priority
        self._changed = True

    def _fail(self, engine_scheduler: SchedulerPort[Any], what: str) -> NoReturn:
        self._sound = False
        raise ShadowDivergence(
            f"check mode, step {self.step}: {what}\n"
            f"--- engine scheduler ---\n{_dump(engine_scheduler.snapshot())}\n"
            f"--- reference scheduler ---\n{_dump(self.ref.snapshot())}"
        )

    def _begin(self, engine_scheduler: SchedulerPort[Any]) -> None:
        """A hook starts: until it ends, close() does not compare (it may be interrupted half-way)."""
        self._engine = engine_scheduler
        self._sound = False
        self._changed = True

    def _end(self) -> None:
        self._sound = True

    def _check_step(self, engine_scheduler: SchedulerPort[Any], touched: Iterable[int],
                    batch: list[Any] | None = None) -> None:
        """CHECK-2: the touched blocks and the number of free blocks read the same on both schedulers; on the
        engine's, the invariants that read no block, the batch invariants (with ``batch``, right after schedule())
        and the one-block ones over ``touched``. (The reference's invariants are checked at every full
        comparison: the reference is the lesson, and what it decides is compared every step.)"""
        mine, ref = engine_scheduler.blocks, self.ref.blocks
        if mine.num_free != ref.num_free:
            self._fail(engine_scheduler, f"free blocks engine={mine.num_free} reference={ref.num_free}")
        touched = sorted(touched)
        for block_id in touched:
            if not 0 <= block_id < mine.num_blocks:
                self._fail(engine_scheduler, f"block {block_id} does not exist ({mine.num_blocks} blocks)")
        read = [[(blocks.ref_count(b), blocks.block_hash(b), blocks.token_ids_of(b), blocks.is_used(b))
                 for b in touched] for blocks in (mine, ref)]
        if read[0] != read[1]:
            block_id, a, b = next((i, v, w) for i, v, w in zip(touched, *read, strict=True) if v != w)
            self._fail(engine_scheduler, f"block {block_id} (touched by this step) engine (ref_count, hash, tokens, "
                                         f"used)={a} reference={b}")
        views = {b: BlockView(b, r, h, t) for b, (r, h, t, _) in zip(touched, read[0], strict=True)}
        state = self._with_policy(light_state(engine_scheduler, views))  # the batch checks' blocks: mostly these
        violations = check_live(state, between_steps=batch is None)
        if batch is not None:  # the batch's views are the state's own (every member is waiting or running)
            views_by_id = {v.seq_id: v for v in (*state.running, *state.waiting)}
            batch_views = [views_by_id.get(s.seq_id) or live_view(s) for s in batch]
            violations += check_batch(state, batch_views, self.is_prefill)
        used = [(views[b], is_used) for b, (_, _, _, is_used) in zip(touched, read[0], strict=True)]
        violations += check_blocks(used, held_counts(engine_scheduler), state.block_size)
        if violations:
            self._fail(engine_scheduler, "engine scheduler breaks " + "; ".join(map(str, violations)))

    def _compare_full(self, engine_scheduler: SchedulerPort[Any], when: str) -> None:
        """CHECK-3: the whole states equal (every block, the free queue in order, the used blocks, the prefix
        table, the queues by arrival) and every invariant on both."""
        engine_state = self._with_policy(self._full[0].read(engine_scheduler))
        ref_state = dataclasses.replace(self._full[1].read(self.ref), **self.reference.policy_state())
        if self.config.policy == "lpm":
            self._compare_passes(engine_scheduler, engine_state, ref_state, when)
        violations = check_state(engine_state)
        if violations:
            self._fail(engine_scheduler, f"engine scheduler breaks (full check {when}) "
                                         + "; ".join(map(str, violations)))
        (refs, hashes, tokens), (ref_refs, ref_hashes, ref_tokens) = self._full[0].columns, self._full[1].columns
        if (refs, hashes, tokens) != (ref_refs, ref_hashes, ref_tokens):
            block_id = next(b for b in range(min(len(refs), len(ref_refs)))
                            if (refs[b], hashes[b], tokens[b]) != (ref_refs[b], ref_hashes[b], ref_tokens[b]))
            self._fail(engine_scheduler, f"block {block_id} (full check {when}) engine={engine_state.blocks[block_id]}"
                                         f" reference={ref_state.blocks[block_id]}")
        parts = (("free queue", engine_state.free_block_ids, ref_state.free_block_ids),
                 ("used blocks", sorted(engine_state.used_block_ids), sorted(ref_state.used_block_ids)),
                 ("prefix table", sorted(engine_state.hash_to_block_id.items()),
                  sorted(ref_state.hash_to_block_id.items())))
        for what, mine, ref in parts:
            if mine != ref:
                self._fail(engine_scheduler, f"{what} (full check {when}): engine={_head(mine)} reference={_head(ref)}")
        engine_arrival = {seq_id: r.arrival for seq_id, r in self._live.items()}
        for queue, engine_views, ref_views in (("waiting", engine_state.waiting, ref_state.waiting),
                                                ("running", engine_state.running, ref_state.running)):
            mine_seqs = [_seq_row(engine_arrival.get(v.seq_id, -1), v) for v in engine_views]
            ref_seqs = [_seq_row(self.arrival_of.get(v.seq_id, -1), v) for v in ref_views]
            if mine_seqs != ref_seqs:
                self._fail(engine_scheduler, f"{queue} (full check {when}): engine={mine_seqs} reference={ref_seqs}")
        # The states are equal where the invariants that read blocks look (INV-1..5: the blocks, the free
        # queue, the used set, the prefix table, the tables), so those hold on the reference as on the engine; the
        # rest read the sequences' ids and statuses, which the comparison does not.
        violations = check_live(ref_state)
        if violations:
            self._fail(engine_scheduler, f"reference scheduler breaks (full check {when}) "
                                         + "; ".join(map(str, violations)))
        self.full_comparisons += 1
        self._changed = False

    def after_schedule(
        self, engine_scheduler: SchedulerPort[Any], batch: Sequence[Arrived], is_prefill: bool, preempted: list[int],
        hits: tuple[int, int] | None = None,
    ) -> None:
        """``hits``: the engine's prefix-cache hit and query tokens this step, compared when given."""
        self._begin(engine_scheduler)
        try:
            out = self.ref.schedule()
        except EmptyDecodeError:
            self._fail(engine_scheduler, "the reference hit the empty decode (EDGE-2), the engine scheduled a batch")
        self._changed = True
        self.batch, self.is_prefill = out.batch, out.is_prefill
        ref_preempted = [self.arrival_of[s.seq_id] for s in out.preempted]
        mine = [_decision(r.arrival, r.seq) for r in batch]
        ref = [_decision(self.arrival_of[s.seq_id], s) for s in self.batch]
        if is_prefill != self.is_prefill:
            self._fail(engine_scheduler, f"is_prefill engine={is_prefill} reference={self.is_prefill}")
        if mine != ref:
            self._fail(engine_scheduler, f"batch (arrival, tokens, cached, length, blocks) engine={mine} "
                                         f"reference={ref}")
        if sorted(preempted) != sorted(ref_preempted):
            self._fail(engine_scheduler, f"preempted arrivals engine={preempted} reference={ref_preempted}")
        ref_hits = (out.prefix_hit_tokens, out.prefix_query_tokens)
        if hits is not None and hits != ref_hits:
            self._fail(engine_scheduler, f"prefix-cache (hit, query) tokens engine={hits} reference={ref_hits}")
        touched = self._touched
        touched.clear()
        for arrival in preempted:
            touched.update(self._tables.pop(arrival, ()))
        tables = self._tables
        for arrival, _, _, _, table in mine:
            touched.update(_touched_by_growth(tables.get(arrival), table))
            tables[arrival] = table
        self._grants = [(arrival, cached, granted) for arrival, granted, cached, _, _ in mine]
        self._check_step(engine_scheduler, touched, [r.seq for r in batch])
        self._end()

    def after_postprocess(self, engine_scheduler: SchedulerPort[Any], tokens: list[int], finished: list[int]) -> None:
        self._begin(engine_scheduler)
        done = self.ref.postprocess(self.batch, tokens, self.is_prefill)  # the stop sets too (ENG-15)
        ref_finished = [self.arrival_of[s.seq_id] for s in done]
        if sorted(finished) != sorted(ref_finished):
            self._fail(engine_scheduler, f"finished arrivals engine={finished} reference={ref_finished}")
        touched, tables, size = self._touched, self._tables, self.ref.config.block_size
        touched.clear()  # what schedule() touched was checked after it
        for arrival, cached, granted in self._grants:
            touched.update(_filled(tables.get(arrival, []), cached, granted, size))
        for a in ref_finished:
            touched.update(tables.pop(a, ()))
            self._forget(a)
        self.batch = []
        self._check_step(engine_scheduler, touched)
        if (self.step + 1) % self.full_every == 0 or not self.by_arrival:
            self._compare_full(engine_scheduler, "after the step" if self.by_arrival else "with nothing live")
        self.step += 1
        self._end()

    def abort(self, engine_scheduler: SchedulerPort[Any], arrival: int, engine_arrivals: dict[int, int]) -> None:
        """ABORT-8: the engine aborted this live arrival between steps; the reference aborts it too.

        ``engine_arrivals`` maps the engine's live seq ids to arrivals.
        """
        self._begin(engine_scheduler)
        seq = self._forget(arrival)
        self.ref.abort(seq)
        self._compare_queues(engine_scheduler, engine_arrivals, f"abort of arrival {arrival}")
        self._check_step(engine_scheduler, self._tables.pop(arrival, ()))  # the released blocks, the free count
        if not self.by_arrival:
            self._compare_full(engine_scheduler, "after an abort, with nothing live")
        self._end()

    def fail_step(self, engine_scheduler: SchedulerPort[Any], failed: list[int],
                  engine_arrivals: dict[int, int]) -> None:
        """FAULT-2: the engine's step failed after schedule(); the reference fails the same batch."""
        self._begin(engine_scheduler)
        mine = [self.arrival_of[s.seq_id] for s in self.batch]
        if failed != mine:
            self._fail(engine_scheduler, f"failed batch engine={failed} reference={mine}")
        self.ref.abort_step(self.batch)
        for a in mine:
            self._forget(a)
            self._tables.pop(a, None)
        self.batch = []
        self._compare_queues(engine_scheduler, engine_arrivals, f"failed step {mine}")
        self._compare_full(engine_scheduler, "after a failed step")  # the free queue too: the release order
        self.step += 1
        self._end()

    def _forget(self, arrival: int) -> SeqLike:
        """A request finished or was aborted: drop it from the maps."""
        seq = self.by_arrival.pop(arrival)
        del self.arrival_of[seq.seq_id]
        self._priority.pop(arrival, None)
        self._engine_ids.pop(arrival, None)
        return seq

    def _with_policy(self, state: SchedulerState) -> SchedulerState:
        """The engine's ``state`` with the policy's fields: the priorities its live requests were added with (under
        ``priority``), the patience (under ``lpm``: the counts are compared at full comparisons)."""
        config = self.config
        state.policy, state.patience = config.policy, config.patience if config.policy == "lpm" else 0
        if config.policy == "priority":
            arrival = {seq_id: a for a, seq_id in self._engine_ids.items()}
            state.priorities = {s.seq_id: self._priority[arrival[s.seq_id]]
                                for s in (*state.running, *state.waiting) if s.seq_id in arrival}
        return state

    def _compare_passes(self, engine_scheduler: SchedulerPort[Any], engine_state: SchedulerState,
                        ref_state: SchedulerState, when: str) -> None:
        """Under ``lpm``: the engine's own counts of passes (its ``policy_state``'s) are the reference's, by arrival."""
        engine_arrival = {seq_id: r.arrival for seq_id, r in self._live.items()}
        engine_state.passes = engine_scheduler.policy_state().get("passes", {})
        mine = {engine_arrival.get(k, -1): v for k, v in engine_state.passes.items()}
        ref = {self.arrival_of.get(k, -1): v for k, v in ref_state.passes.items()}
        if mine != ref:
            self._fail(engine_scheduler, f"lpm passes by arrival (full check {when}): engine={mine} reference={ref}")

    def _compare_queues(self, engine_scheduler: SchedulerPort[Any], engine_arrivals: dict[int, int],
                        what: str) -> None:
        """The same waiting and running queues, by arrival. (The free queue's order, the order of a release, is
        compared whole at the next full comparison; a difference shows sooner in the tables of the first step
        that takes a released block, since the front of the free queue is handed out first.)"""
        queues = (("waiting", engine_scheduler.waiting, self.ref.waiting),
                  ("running", engine_scheduler.running, self.ref.running))
        for name, engine_queue, ref_queue in queues:
            mine = [engine_arrivals[s.seq_id] for s in engine_queue]
            ref = [self.arrival_of[s.seq_id] for s in ref_queue]
            if mine != ref:
                self._fail(engine_scheduler, f"{name} after {what}: engine={mine} reference={ref}")


def _seq_row(arrival: int, view: Any) -> tuple[Any, ...]:
    """A sequence as the full comparison sees it: by arrival, never by seq_id or status (ARCH-4)."""
    return (arrival, view.token_ids, view.num_prompt_tokens, view.num_cached_tokens, view.num_scheduled_tokens,
            view.block_table, view.max_tokens, view.is_prefill)


def _head(items: list[Any]) -> str:
    return f"{items[:16]}{' ...' if len(items) > 16 else ''} ({len(items)})"
