"""A hypothesis state machine that drives the reference and the optimized scheduler with the same operations.

Each run draws a tiny configuration (half the runs a tight one: blocks of two
tokens, two to six of them, short budgets; the others block size 2-16, mostly
2-4, a handful of blocks), whether requests must obey the admission rule
(ADMIT-1) or may overflow the cache, and its swarm (``Swarm``, MUT-8): which
rules may fire, whether the model is greedy (a token per length, so equal
prompts continue alike) or drawn, how often a request has stop tokens, and
whether arrivals follow earlier requests. Rules add requests whose prompts
share prefixes (so the prefix cache hits): a prompt starts with a drawn prefix
or with all or part of an earlier request's tokens (prompt and output so far;
in a following run most often a running request's, with a tail up to the
whole cache), then goes on, so prompts share and extend each other and hit
blocks that decode filled; cache hits are freed and walked again while a
request waits (MUT-8). Rules run steps (the same model tokens to both), give
some requests stop tokens that
finish it beside EOS (OPT-24: the port's ``add`` takes the stop set), and
sometimes hand the batch back to postprocess as a copy of the list schedule()
returned, which the optimized scheduler must treat like the list itself. At most MAX_LIVE
requests are live at once, and a rule lets the queue drain, so a run is many
small workloads on one cache. After every schedule() and every
postprocess() the two must agree on every decision, compared by arrival
index: batch order, num_scheduled_tokens, block tables, the prefill flag,
preemptions, finishes, queue orders, every sequence's counters and tokens,
the whole block-manager state (free-queue order, ref counts, hashes, prefix
table) and the policy's state (its name, each live request's priority, each
waiting one's passes, the patience: POLICY-13), and the walk the optimized scheduler remembers for a waiting request
must be the walk it would make afresh (OPT-15). Both must hit the empty decode (the port's EmptyDecodeError; the
reference's adapter raises it where the lesson's assert fires) at the same
step, and leave the same state behind it: the run goes on after it, so later
steps compare too. Beyond the lesson
(spec/abort.md), the same live request - waiting, mid-chunk or running - is
aborted in both now and then (the port's ``abort``), and a step sometimes
fails after schedule(), its batch aborted in both (``abort_step``); the states
must agree after it and every later decision too. Every invariant of
spec/invariants.md is checked on both. Both schedulers are driven through the
scheduler port (ARCH-4), the reference through its adapter, so what each step
reports (preempted, prefix hits, finished) is compared too. The machine's
only outside effect is the ``Stats`` it was handed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from invariants import SchedulerState, Violation, check_batch, check_state, seq_view
from optimized.core.config import SchedulerConfig
from optimized.core.port import EmptyDecodeError, ScheduleOutput, SchedulerPort
from optimized.core.scheduler import Scheduler
from optimized.verify.conformance import implementation
from optimized.verify.machines import Stats
from optimized.verify.machines.failure_rule import FailureRule

EOS = 7
TOKENS = st.integers(1, 3)  # few distinct ids: prompts collide and blocks get shared
MODEL_TOKENS = st.integers(1, EOS)
MAX_REQUEST_TOKENS = 40
# Arrivals wait while this many requests are live, so that runs are many small workloads on a shared cache
# (requests finish, their blocks are freed and hit again) rather than one queue that only grows.
MAX_LIVE = 5
DRAIN_STEPS = 30

roomy_configs = st.builds(
    SchedulerConfig,
    num_blocks=st.integers(1, 8),
    block_size=st.one_of(st.integers(2, 4), st.integers(2, 16)),
    max_num_seqs=st.integers(1, 5),
    max_num_batched_tokens=st.integers(1, 32),
    eos=st.just(EOS),
)
# Few blocks of two tokens and short budgets: every request fights for the cache, hits are freed and taken again.
tight_configs = st.builds(
    SchedulerConfig,
    num_blocks=st.integers(2, 6),
    block_size=st.just(2),
    max_num_seqs=st.integers(1, 3),
    max_num_batched_tokens=st.integers(2, 12),
    eos=st.just(EOS),
)
configs = st.one_of(tight_configs, roomy_configs)


@dataclass(frozen=True)
class Swarm:
    """One run's mix (swarm testing, MUT-8): which rules may fire, and how requests and model tokens are drawn.

    A rule left out makes the others more frequent, so each run explores its own corner (say, arrivals and
    single steps only, never a drain). ``greedy`` is a model that draws the token for a sequence of length n as
    ``greedy[n % len(greedy)]``: equal prompts continue alike, so a later request hits the blocks an earlier
    one filled in decode; None draws every token. ``follow``: most arrivals continue an earlier request's
    tokens (a shared prefix, then a short tail), the pattern where hits are freed and hit again.
    """

    single: bool
    burst: bool
    one_step: bool
    several_steps: bool
    drain: bool
    faults: bool
    greedy: tuple[int, ...] | None
    stop_one_in: int  # one request in this many gets stop tokens; 0: none
    follow: bool


swarms = st.builds(
    Swarm,
    single=st.booleans(), burst=st.booleans(), one_step=st.booleans(), several_steps=st.booleans(),
    drain=st.booleans(), faults=st.booleans(),
    greedy=st.none() | st.lists(MODEL_TOKENS, min_size=1, max_size=6).map(tuple),
    stop_one_in=st.sampled_from((0, 8, 2)),
    follow=st.booleans(),
).filter(lambda w: (w.single or w.burst) and (w.one_step or w.several_steps or w.drain))


class Disagreement(AssertionError):
    """The two schedulers made different decisions, or one broke an invariant."""


def _ids(seqs: Any, arrival: dict[int, int]) -> list[int]:
    return [arrival[s.seq_id] for s in seqs]


def _seq_fields(seq: Any) -> tuple[Any, ...]:
    """Everything a sequence says of itself but its id (the two number their sequences independently)."""
    view = seq_view(seq)
    return (view.status, view.token_ids, view.num_prompt_tokens, view.num_cached_tokens, view.num_scheduled_tokens,
            view.block_table, view.max_tokens, view.is_prefill, seq.num_tokens, len(seq), seq.ignore_eos,
            seq.temperature, seq.num_completion_tokens, list(seq.completion_token_ids))


def _by_arrival(per_seq: dict[int, int], arrival: dict[int, int]) -> dict[int | str, int]:
    """A per-sequence map keyed by arrival index; a sequence the machine never added stays visible as such."""
    return {arrival.get(seq_id, f"unknown seq {seq_id}"): value for seq_id, value in per_seq.items()}


def _state_fields(state: SchedulerState, arrival: dict[int, int]) -> tuple[Any, ...]:
    """The block manager, the queues and the policy's own state (POLICY-13): priorities, passes, patience."""
    blocks = [(b.block_id, b.ref_count, b.hash, b.token_ids) for b in state.blocks]
    return (blocks, state.free_block_ids, sorted(state.used_block_ids), sorted(state.hash_to_block_id.items()),
            [arrival[s.seq_id] for s in state.waiting], [arrival[s.seq_id] for s in state.running],
            state.policy, state.patience, _by_arrival(state.priorities, arrival), _by_arrival(state.passes, arrival))


class DifferentialMachine(FailureRule):
    """The same serving loop on both schedulers; every decision and state must be equal (OPT-1).

    ``policy`` is the scheduling policy both run (spec/policies.md): a subclass per policy; under ``priority``
    each request draws a priority, under ``lpm`` each run a patience.
    """

    policy = "lesson"

    def __init__(self, stats: Stats | None = None) -> None:
        super().__init__()
        self.stats = stats if stats is not None else Stats()
        self.stats.examples += 1
        self.config = SchedulerConfig(num_blocks=1, block_size=2)
        self.ref: SchedulerPort[Any] | None = None
        self.opt: SchedulerPort[Any] | None = None
        self.opt_core: Scheduler | None = None  # self.opt, for the one check of its insides (OPT-15)
        self.admission_rule = True
        self.swarm = Swarm(True, True, True, True, True, True, None, 8, False)
        self.prefixes: list[list[int]] = []
        self.ref_seqs: list[Any] = []  # by arrival index
        self.opt_seqs: list[Any] = []
        self.ref_arrival: dict[int, int] = {}
        self.opt_arrival: dict[int, int] = {}

    # --- setup and arrivals ----------------------------------------------------------------------
    @initialize(config=configs, admission_rule=st.booleans(), swarm=swarms,
                prefixes=st.lists(st.lists(TOKENS, max_size=MAX_REQUEST_TOKENS), min_size=1, max_size=3),
                patience=st.integers(0, 4))
    def a_server_starts(self, config: SchedulerConfig, admission_rule: bool, swarm: Swarm,
                        prefixes: list[list[int]], patience: int) -> None:
        self.stats.rule_applications += 1
        config = dataclasses.replace(config, policy=self.policy, patience=patience)
        self.config = config
        self.admission_rule = admission_rule
        self.swarm = swarm
        self.prefixes = prefixes
        self.ref = implementation("reference")(config)
        opt = implementation("optimized")(config)
        assert isinstance(opt, Scheduler)  # every policy's optimized class is the core scheduler's subclass
        self.opt = self.opt_core = opt

    def room(self) -> int:
        """How many requests may still arrive now (MAX_LIVE)."""
        if self.ref is None:
            return 0
        return MAX_LIVE - len(self.ref.waiting) - len(self.ref.running)

    @precondition(lambda self: self.swarm.single and self.room() > 0)
    @rule(data=st.data())
    def a_request_arrives(self, data: st.DataObject) -> None:
        """The same prompt to both; without the admission rule max_tokens may overflow the cache."""
        self.stats.rule_applications += 1
        self.arrive(data)

    @precondition(lambda self: self.swarm.burst and self.room() > 1)
    @rule(data=st.data(), n=st.integers(2, 4))
    def a_burst_arrives(self, data: st.DataObject, n: int) -> None:
        """Several requests at once: they compete for blocks, so decode preempts."""
        self.stats.rule_applications += 1
        for _ in range(min(n, self.room())):
            self.arrive(data)

    def arrive(self, data: st.DataObject) -> None:
        assert self.ref is not None and self.opt is not None
        capacity = self.config.num_blocks * self.config.block_size
        limit = capacity if self.admission_rule else 2 * capacity
        longest = min(capacity, MAX_REQUEST_TOKENS)
        earlier = [list(r.token_ids) for r in self.ref_seqs]  # prompts and outputs so far: prefixes to extend
        if self.swarm.follow and earlier and data.draw(st.integers(0, 3), label="follow an earlier request") > 0:
            # An earlier request's tokens up to a drawn point (most often a running one's: its blocks are held),
            # then a tail, short or up to the whole cache: it hits what that one filled, and a long one waits
            # while the blocks it hit are freed and taken again.
            running: list[list[int]] = [list(r.token_ids) for r in self.ref.running]
            sources = earlier
            if running:
                follow_running: bool = data.draw(st.booleans(), label="follow a running request")
                sources = running if follow_running else earlier
            shared = data.draw(st.sampled_from(sources), label="followed request")
            shared = shared[: data.draw(st.integers(0, len(shared)), label="followed tokens")]
            long_follower: bool = data.draw(st.booleans(), label="long follower")
            most = longest if long_follower else 2 * self.config.block_size
            length = max(1, min(longest, len(shared) + data.draw(st.integers(0, most), label="tail length")))
        else:
            # The length first, uniform up to the whole cache: long prompts keep later ones waiting (MUT-8).
            length = data.draw(st.integers(1, longest), label="prompt length")
            shared = data.draw(st.sampled_from(self.prefixes + earlier), label="prefix")
        shared = shared[:length]
        footprint = data.draw(st.integers(length, max(length, min(limit, MAX_REQUEST_TOKENS))), label="footprint")
        tail = data.draw(st.lists(TOKENS, min_size=length - len(shared), max_size=length - len(shared)), label="tail")
        max_tokens = footprint - length + 1
        ignore_eos = data.draw(st.booleans(), label="ignore_eos")
        # Stop tokens for one request in stop_one_in (eight in most runs), so most live long enough to hold blocks.
        every = self.swarm.stop_one_in
        with_stops = every > 0 and data.draw(st.integers(0, every - 1), label="stop tokens for this request") == 0
        stops = data.draw(st.frozensets(MODEL_TOKENS, min_size=1, max_size=2), label="stop tokens") if with_stops \
            else frozenset[int]()
        prompt = shared + tail
        r = self.ref.new_sequence(prompt, max_tokens, ignore_eos)
        o = self.opt.new_sequence(prompt, max_tokens, ignore_eos)
        index = len(self.ref_seqs)
        self.ref_arrival[r.seq_id] = index
        self.opt_arrival[o.seq_id] = index
        self.ref_seqs.append(r)
        self.opt_seqs.append(o)
        priority = data.draw(st.integers(0, 2), label="priority") if self.policy == "priority" else 0
        self.ref.add(r, stops, priority)
        self.opt.add(o, stops, priority)
        self.stats.requests += 1
        self.compare("add")

    # --- steps ---------------------------------------------------------------------------------
    def busy(self) -> bool:
        return self.ref is not None and not self.ref.is_finished()

    def may_fail(self) -> bool:
        return self.swarm.faults

    @precondition(lambda self: self.swarm.one_step and self.busy())
    @rule(data=st.data())
    def a_step_runs(self, data: st.DataObject) -> None:
        self.stats.rule_applications += 1
        self.step(data)

    @precondition(lambda self: self.swarm.several_steps and self.busy())
    @rule(data=st.data(), n=st.integers(2, 8))
    def time_passes(self, data: st.DataObject, n: int) -> None:
        """Several steps without arrivals."""
        self.stats.rule_applications += 1
        for _ in range(n):
            if not self.busy():
                break
            self.step(data)

    @precondition(lambda self: self.swarm.drain and self.busy())
    @rule(data=st.data())
    def the_queue_drains(self, data: st.DataObject) -> None:
        """Steps until every request is done (DRAIN_STEPS at most): the cache is left full of freed, hashed blocks."""
        self.stats.rule_applications += 1
        for _ in range(DRAIN_STEPS):
            if not self.busy():
                break
            self.step(data)

    def schedule_both(self) -> tuple[list[Any], list[Any], bool] | None:
        """schedule() on both, compared and checked; None (counted as a step) at an empty decode in both."""
        assert self.ref is not None and self.opt is not None
        ref_out: ScheduleOutput[Any] | None = None
        opt_out: ScheduleOutput[Any] | None = None
        with contextlib.suppress(EmptyDecodeError):  # the lesson's assert scheduled_seqs, through its adapter
            ref_out = self.ref.schedule()
        with contextlib.suppress(EmptyDecodeError):
            opt_out = self.opt.schedule()
        if (ref_out is None) != (opt_out is None):
            raise Disagreement(f"OPT-9: empty decode in {'reference' if ref_out is None else 'optimized'} only")
        self.compare("schedule", between_steps=False)
        if ref_out is None or opt_out is None:
            self.stats.steps += 1
            return None
        ref_batch, ref_prefill, opt_batch, opt_prefill = ref_out.batch, ref_out.is_prefill, opt_out.batch, \
            opt_out.is_prefill
        if ref_prefill != opt_prefill or _ids(ref_batch, self.ref_arrival) != _ids(opt_batch, self.opt_arrival):
            raise Disagreement(f"OPT-1: batches differ: {ref_batch} {ref_prefill} / {opt_batch} {opt_prefill}")
        for r, o in zip(ref_batch, opt_batch, strict=True):
            if _seq_fields(r) != _seq_fields(o):
                raise Disagreement(f"OPT-1: scheduled sequence differs: {_seq_fields(r)} / {_seq_fields(o)}")
        reports = [(_ids(out.preempted, arrival), out.prefix_hit_tokens, out.prefix_query_tokens)
                   for out, arrival in ((ref_out, self.ref_arrival), (opt_out, self.opt_arrival))]
        if reports[0] != reports[1]:
            raise Disagreement(f"OPT-22: (preempted, prefix hits, lookups) differ: {reports[0]} / {reports[1]}")
        self.check(self.opt, opt_batch, opt_prefill)
        self.check(self.ref, ref_batch, ref_prefill)
        self.stats.preemptions += len(ref_out.preempted)
        self.stats.prefix_hit_tokens += ref_out.prefix_hit_tokens
        return ref_batch, opt_batch, ref_prefill

    def step(self, data: st.DataObject) -> None:
        scheduled = self.schedule_both()
        if scheduled is None:
            return
        ref_batch, opt_batch, is_prefill = scheduled
        ref_prefill = opt_prefill = is_prefill
        assert self.ref is not None and self.opt is not None
        greedy = self.swarm.greedy
        if greedy is None:
            tokens = data.draw(st.lists(MODEL_TOKENS, min_size=len(ref_batch), max_size=len(ref_batch)),
                               label="tokens")
        else:
            tokens = [greedy[len(s) % len(greedy)] for s in ref_batch]
        if data.draw(st.booleans(), label="batch handed back as a copy"):
            ref_batch, opt_batch = list(ref_batch), list(opt_batch)
        finished = [_ids(self.ref.postprocess(ref_batch, tokens, ref_prefill), self.ref_arrival),
                    _ids(self.opt.postprocess(opt_batch, tokens, opt_prefill), self.opt_arrival)]
        if finished[0] != finished[1]:
            raise Disagreement(f"OPT-1: finishes differ: {finished}")
        self.stats.steps += 1
        self.compare("postprocess")

    # --- beyond the lesson: aborts and failed steps (ABORT-6: both take the same request(s) back) ------------
    def a_request_is_aborted(self, data: st.DataObject) -> None:
        assert self.ref is not None and self.opt is not None
        live = [self.ref_arrival[s.seq_id] for s in (*self.ref.waiting, *self.ref.running)]
        index = data.draw(st.sampled_from(live), label="aborted request")
        self.ref.abort(self.ref_seqs[index])
        self.opt.abort(self.opt_seqs[index])
        self.stats.aborts += 1
        self.compare(f"abort of request {index}")

    def a_step_fails(self) -> None:
        """FAULT-2: schedule() on both, then the batch is withdrawn and aborted instead of postprocessed."""
        assert self.ref is not None and self.opt is not None
        scheduled = self.schedule_both()
        if scheduled is None:
            return
        ref_batch, opt_batch, _is_prefill = scheduled
        self.ref.abort_step(ref_batch)
        self.opt.abort_step(opt_batch)
        self.stats.steps += 1
        self.stats.aborts += len(ref_batch)
        self.compare("failed step")

    def check(self, port: SchedulerPort[Any], batch: list[Any], is_prefill: bool) -> None:
        found: list[Violation] = check_batch(port.snapshot(), [seq_view(s) for s in batch], is_prefill)
        self.stats.violations += len(found)
        if found:
            name = "reference" if port is self.ref else "optimized"
            raise Disagreement(f"{name}: " + "; ".join(map(str, found)))

    # --- the comparison ---------------------------------------------------------------------------
    def compare(self, when: str, between_steps: bool = True) -> None:
        """OPT-1: every sequence and the whole block-manager state agree; both satisfy every invariant."""
        assert self.ref is not None and self.opt is not None
        for index, (r, o) in enumerate(zip(self.ref_seqs, self.opt_seqs, strict=True)):
            if _seq_fields(r) != _seq_fields(o):
                raise Disagreement(f"OPT-1 after {when}: request {index}: {_seq_fields(r)} / {_seq_fields(o)}")
        ref_state, opt_state = self.ref.snapshot(), self.opt.snapshot()
        if _state_fields(ref_state, self.ref_arrival) != _state_fields(opt_state, self.opt_arrival):
            raise Disagreement(f"OPT-1 after {when}: states differ:\n{ref_state}\n{opt_state}")
        for name, state in (("reference", ref_state), ("optimized", opt_state)):
            found = check_state(state, between_steps=between_steps)
            self.stats.violations += len(found)
            if found:
                raise Disagreement(f"{name} after {when}: " + "; ".join(map(str, found)))
        assert self.opt_core is not None
        stale = self.opt_core.block_manager.stale_walk()
        if stale:
            self.stats.violations += 1
            raise Disagreement(f"optimized after {when}: {stale}")

    @invariant()
    def queues_agree(self) -> None:
        """OPT-1: the same requests wait and run, in the same order."""
        if self.ref is None or self.opt is None:
            return
        for name, r_queue, o_queue in (("waiting", self.ref.waiting, self.opt.waiting),
                                       ("running", self.ref.running, self.opt.running)):
            r, o = _ids(r_queue, self.ref_arrival), _ids(o_queue, self.opt_arrival)
            if r != o:
                raise Disagreement(f"OPT-1: {name} differs: {r} / {o}")


Machine = DifferentialMachine
