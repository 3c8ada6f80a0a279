"""A hypothesis state machine that uses the reference scheduler the way a serving loop does.

Each run draws a tiny configuration (block size 2-16, a handful of blocks, a
small token budget and max_num_seqs), then interleaves requests arriving with
steps (schedule, then postprocess with one model token per scheduled sequence,
EOS now and then). Prompts share prefixes so the prefix cache hits, and are
long against the budget and the cache so chunking and preemption happen.
Beyond the lesson (spec/abort.md), a live request is aborted now and then -
waiting, mid-chunk or running - and a step sometimes fails after schedule(),
its batch aborted; both are checked against abort_contract.py. The scheduler
is driven through the scheduler port (ARCH-4): the reference by its adapter,
or, in a subclass that names another ``IMPLEMENTATION``, any other one, judged
by the same contracts.
Requests obey the admission rule (ADMIT-1) unless a subclass turns it off.
Every step is checked against the step contract (step_contract.py) and every
state against ``invariants.check_state``; a failure names the broken clause.
The machine's only outside effect is the ``Stats`` it was handed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from invariants import SchedulerState, SeqView, Violation, check_batch, check_state, seq_view
from optimized.core.config import SchedulerConfig
from optimized.core.port import EmptyDecodeError, SchedulerPort
from optimized.verify.conformance import implementation
from optimized.verify.machines import Stats
from optimized.verify.machines.abort_contract import check_abort, check_abort_step
from optimized.verify.machines.failure_rule import FailureRule
from optimized.verify.machines.step_contract import check_postprocess, check_schedule

EOS = 9
PROMPT_TOKENS = st.integers(1, 3)  # three token ids: prompts collide, so blocks get shared
MODEL_TOKENS = st.integers(1, EOS)  # shrinks towards 1, away from EOS
MAX_REQUEST_TOKENS = 40  # keeps a run's step count small when the budget is 1 token

configs = st.builds(
    SchedulerConfig,
    num_blocks=st.integers(1, 8),
    block_size=st.integers(2, 16),
    max_num_seqs=st.integers(1, 4),
    max_num_batched_tokens=st.integers(1, 24),
    eos=st.just(EOS),
)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def admissible(prompt_len: int, max_tokens: int, config: SchedulerConfig) -> bool:
    """ADMIT-1: the request's longest KV footprint fits the whole cache."""
    return ceil_div(prompt_len + max_tokens - 1, config.block_size) <= config.num_blocks


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool


@st.composite
def requests(draw: st.DrawFn, config: SchedulerConfig, prefixes: list[list[int]], admission_rule: bool) -> Request:
    """A request whose prompt starts with one of ``prefixes``; half of them are long enough to fill the cache."""
    capacity = config.num_blocks * config.block_size
    # Without the rule only max_tokens may overflow the cache: the prompt alone still fits.
    limit = min(capacity if admission_rule else 2 * capacity, MAX_REQUEST_TOKENS)
    long = draw(st.booleans())  # long requests fill the cache, so decode steps must preempt
    footprint = draw(st.integers(max(1, limit // 2) if long else 1, limit))  # len(prompt) + max_tokens - 1
    prompt_len = draw(st.integers(1, min(footprint, capacity)))
    shared = prefixes[draw(st.integers(0, len(prefixes) - 1))][:prompt_len]
    rest = prompt_len - len(shared)
    prompt = shared + draw(st.lists(PROMPT_TOKENS, min_size=rest, max_size=rest))
    return Request(prompt, footprint - prompt_len + 1, draw(st.booleans()))


class StepFailed(AssertionError):
    """A step broke spec clauses; the message lists them."""


class Machine(FailureRule):
    """Requests arrive and steps run; the spec's clauses hold after every rule."""

    ADMISSION_RULE: ClassVar[bool] = True
    IMPLEMENTATION: ClassVar[str] = "reference"  # a name ``conformance.implementation`` knows

    def __init__(self, stats: Stats | None = None) -> None:
        super().__init__()
        self.stats = stats if stats is not None else Stats()
        self.stats.examples += 1
        self._scheduler: SchedulerPort[Any] | None = None
        self.config = SchedulerConfig(num_blocks=1, block_size=2)
        self.prefixes: list[list[int]] = []
        self.request_strategy: st.SearchStrategy[Request] = st.nothing()
        self.requests: dict[int, Request] = {}
        self.finished: set[int] = set()
        self.steps = 0
        self.step_bound = 0  # ADMIT-3, grown as requests arrive and preemptions happen
        self.last_violations: list[Violation] = []

    @property
    def scheduler(self) -> SchedulerPort[Any]:
        assert self._scheduler is not None, "initialize runs before every rule"
        return self._scheduler

    @initialize(config=configs, prefixes=st.lists(st.lists(PROMPT_TOKENS, max_size=MAX_REQUEST_TOKENS),
                                                  min_size=1, max_size=3))
    def a_server_starts(self, config: SchedulerConfig, prefixes: list[list[int]]) -> None:
        self.stats.rule_applications += 1
        self.config = config
        self.prefixes = prefixes
        self.request_strategy = requests(config, prefixes, self.ADMISSION_RULE)
        self._scheduler = implementation(self.IMPLEMENTATION)(config)

    @rule(data=st.data(), n=st.integers(1, 3))
    def requests_arrive(self, data: st.DataObject, n: int) -> None:
        """Users submit prompts that share prefixes with earlier ones; ADMIT-1 admits them."""
        self.stats.rule_applications += 1
        for _ in range(n):
            self.add(data.draw(self.request_strategy, label="request"))

    def add(self, request: Request) -> None:
        # The strategy keeps footprints within the cache; this states that it does.
        assert admissible(len(request.prompt), request.max_tokens, self.config) or not self.ADMISSION_RULE
        seq = self.scheduler.new_sequence(request.prompt, request.max_tokens, request.ignore_eos)
        self.requests[seq.seq_id] = request
        self.scheduler.add(seq)
        self.stats.requests += 1
        self.step_bound += request.max_tokens + ceil_div(len(request.prompt), self.config.max_num_batched_tokens)

    @precondition(lambda self: self.busy())
    @rule(data=st.data())
    def a_step_runs(self, data: st.DataObject) -> None:
        """One schedule() and its postprocess(), the model answering each scheduled sequence."""
        self.stats.rule_applications += 1
        self.step(data)

    @precondition(lambda self: self.busy())
    @rule(data=st.data(), n=st.integers(2, 8))
    def time_passes(self, data: st.DataObject, n: int) -> None:
        """Several steps with no arrival, as when the server is busy generating."""
        self.stats.rule_applications += 1
        for _ in range(n):
            if self.scheduler.is_finished():
                break
            self.step(data)

    def busy(self) -> bool:
        return self._scheduler is not None and not self.scheduler.is_finished()

    def a_request_is_aborted(self, data: st.DataObject) -> None:
        """ABORT-1..3: the request leaves wherever it is (waiting, mid-chunk or running)."""
        live = [*self.scheduler.waiting, *self.scheduler.running]
        seq = data.draw(st.sampled_from(live), label="aborted request")
        before = self.scheduler.snapshot()
        self.scheduler.abort(seq)
        self.finished.add(seq.seq_id)
        self.stats.aborts += 1
        self.last_violations = check_abort(before, self.scheduler.snapshot(), seq.seq_id)
        self.stats.violations += len(self.last_violations)

    def a_step_fails(self) -> None:
        """FAULT-2: the model raises after schedule(); the batch's grants are withdrawn and its members aborted."""
        batch, _is_prefill, state, found = self.schedule()
        self.scheduler.abort_step(batch)
        ids = [s.seq_id for s in batch]
        self.finished.update(ids)
        self.steps += 1
        self.step_bound += 1  # a failed step is a schedule() call the liveness bound did not charge
        self.stats.steps += 1
        self.stats.aborts += len(ids)
        found += check_abort_step(state, self.scheduler.snapshot(), ids)
        self.stats.violations += len(found)
        self.last_violations = found

    def schedule(self) -> tuple[list[Any], bool, SchedulerState, list[Violation]]:
        """One schedule(), checked: its batch, the prefill flag, the state right after it and what it broke."""
        before = self.scheduler.snapshot()
        try:
            batch, is_prefill = self.scheduler.schedule()
        except EmptyDecodeError:
            raise EmptyDecodeError(f"EDGE-2: empty decode at step {self.steps}: the only running sequence "
                                   f"preempted itself ({before.running[0] if before.running else None})") from None
        scheduled = self.scheduler.snapshot()
        views = [seq_view(s) for s in batch]
        found = [*check_batch(scheduled, views, is_prefill), *check_schedule(before, scheduled, views, is_prefill)]
        self.count(before, scheduled, views, is_prefill)
        return batch, is_prefill, scheduled, found

    def step(self, data: st.DataObject) -> None:
        batch, is_prefill, scheduled, found = self.schedule()
        views = [seq_view(s) for s in batch]
        tokens = data.draw(st.lists(MODEL_TOKENS, min_size=len(batch), max_size=len(batch)), label="model tokens")
        finished = self.scheduler.postprocess(batch, tokens, is_prefill)
        after = self.scheduler.snapshot()
        ignore_eos = {i: r.ignore_eos for i, r in self.requests.items()}
        found += check_postprocess(scheduled, after, views, tokens, is_prefill, EOS, ignore_eos)
        self.finished.update(s.seq_id for s in finished)
        self.steps += 1
        self.stats.steps += 1
        self.stats.violations += len(found)
        self.last_violations = found

    def count(self, before: SchedulerState, scheduled: SchedulerState, batch: list[SeqView], is_prefill: bool) -> None:
        fresh = {s.seq_id for s in before.waiting if not s.block_table}
        self.stats.prefix_hit_tokens += sum(s.num_cached_tokens for s in batch if is_prefill and s.seq_id in fresh)
        preempted = {s.seq_id for s in before.running} & {s.seq_id for s in scheduled.waiting}
        self.stats.preemptions += len(preempted)
        for seq_id in preempted:
            r = self.requests[seq_id]
            self.step_bound += ceil_div(len(r.prompt) + r.max_tokens - 1, self.config.max_num_batched_tokens)

    @invariant()
    def each_step_keeps_the_scheduler_contract(self) -> None:
        """SCHED-, PREFILL-, CHUNK-, DECODE-, PREEMPT-, POST-, CACHE- clauses of the last step."""
        if self.last_violations:
            raise StepFailed("; ".join(map(str, self.last_violations)))

    @invariant()
    def every_block_and_queue_is_consistent(self) -> None:
        """spec/invariants.md: the state between steps."""
        if self._scheduler is not None:
            found = check_state(self.scheduler.snapshot())
            self.stats.violations += len(found)
            if found:
                raise StepFailed("; ".join(map(str, found)))

    @invariant()
    def every_request_is_waiting_running_or_finished(self) -> None:
        """SCHED-3: no request is lost or duplicated."""
        if self._scheduler is None:
            return
        live = [s.seq_id for s in (*self.scheduler.waiting, *self.scheduler.running)]
        accounted = sorted([*live, *self.finished])
        if accounted != sorted(self.requests):
            raise StepFailed(f"SCHED-3: requests {sorted(self.requests)} but live {live}, finished {self.finished}")

    @invariant()
    def work_finishes_within_the_liveness_bound(self) -> None:
        """ADMIT-3: steps <= sum(max_tokens + ceil(prompt/B)) + sum over preemptions of ceil((P+M-1)/B)."""
        if self.steps > self.step_bound:
            raise StepFailed(f"ADMIT-3: {self.steps} steps exceed the liveness bound {self.step_bound}")


class UnadmittedMachine(Machine):
    """The same users, but max_tokens may overflow the cache: ADMIT-1 is not applied."""

    ADMISSION_RULE: ClassVar[bool] = False
