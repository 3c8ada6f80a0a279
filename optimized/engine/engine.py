"""The step loop: schedule, run the model on the batch, hand the tokens back to the scheduler.

Invariants: a request is validated whole before the scheduler sees it, so a
refused one leaves the scheduler untouched (ENG-10); every sequence the
scheduler holds belongs to exactly one live ``Request``; a step runs the model
on exactly the tokens the scheduler granted and postprocesses exactly that
batch; the scheduler reports whom a step preempted and finished (OPT-22), so
a step does no scan of the live requests. Stop tokens are the scheduler's
(ENG-15, OPT-24): each request's stop set is handed to the scheduler with the
sequence, and postprocess finishes a sequence that draws one, beside EOS.
Every change is told to the engine's observers (``StepObserver``, ARCH-3), in
order: check mode's shadow mirrors it on the reference, the recorder writes it.
Beyond the lesson (spec/abort.md): a live request can be aborted between steps,
and a step whose model run raises fails its batch (FAULT-1, FAULT-2): the
batch's grants are withdrawn, its requests finish with ``"error"``, the
exception propagates, and every other request stays queued; the observers are
told, so the shadow's decisions stay identical. Any other exception
in a step, an add or an abort (a bug, a divergence, a KeyboardInterrupt at an
arbitrary point: FAULT-4) may have left the state half changed: ``busy`` then
still names the interrupted operation, every later call raises RuntimeError
(ENG-11), and the exception itself propagates untouched; a cleanup that fails
never replaces the exception that caused it (FAULT-5). The scheduler
is made in exactly one place, by ``optimized.core.policies.make_scheduler``
from the config's policy (spec/policies.md, POLICY-11), imported below; each
request's priority goes to its ``add`` (POLICY-12). A step of the ``mixed``
policy holds decodes and prefill chunks at once: it is a prefill step to the
runner, whose decodes are one-token chunks (POLICY-17). The engine is not
thread-safe: ``LLM`` serializes calls into it (THREAD-1).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from optimized.core.errors import is_strict_int

# The one import point of the scheduler the engine drives: the factory of the config's policy (each policy's class
# subclasses the lesson's optimized Scheduler and satisfies the scheduler port, ARCH-4).
from optimized.core.policies import make_scheduler
from optimized.core.scheduler import ScheduleOutput, Scheduler, SchedulerConfig, Sequence
from optimized.engine.logprobs import keep
from optimized.engine.model_runner import DrawParams, ModelRunner
from optimized.engine.observer import StepObserver
from optimized.engine.sampling_params import Logprob, SamplingParams
from optimized.engine.validation import EngineLimits, validate_priority, validate_request

__all__ = ["Engine", "EngineLimits", "EngineStats", "Request", "SchedulerConfig", "describe", "validate_request"]


@dataclass
class Request:
    """One request as the engine tracks it; ``arrival`` is its 0-based add order (the LLM's request_id);
    ``priority`` its place under the ``priority`` policy (lower first; 0 under every other, POLICY-12)."""

    arrival: int
    seq: Sequence
    params: SamplingParams
    draw: DrawParams
    stop_ids: frozenset[int]
    priority: int = 0
    finish_reason: str | None = None
    # ENG-18: when asked, one dict per generated token, and one per prompt token (the first's None)
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class EngineStats:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0  # tokens computed in prefill steps (prefix-cache hits excluded)
    decode_tokens: int = 0
    preemptions: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0  # tokens looked up in the prefix cache (each time a sequence gets blocks)
    chunked_prefills: int = 0  # prefill grants that left their sequence's prompt unfinished
    mixed_steps: int = 0  # prefill steps that decoded too (the ``mixed`` policy's, POLICY-2)
    mixed_decode_tokens: int = 0  # the decodes of those steps (counted in ``prefill_tokens`` too)
    compared_steps: int = 0  # steps whose decisions check mode compared with the reference
    aborted_requests: int = 0  # ABORT-8
    failed_steps: int = 0  # FAULT-1: steps whose model run raised (not counted in ``steps``)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0


def describe(error: BaseException) -> str:
    """An exception as one line: its type, and its message when it has one (never raises: FAULT-5)."""
    try:
        text = str(error).strip().splitlines()
    except Exception:  # a broken __str__ must not replace the exception being described
        text = []
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _tell_step_failed(observers: Seq[StepObserver], fault: BaseException, start: float) -> None:
    """Every observer hears of the model's fault; one that raises is noted on ``fault``, never replaces it
    (FAULT-5), and the batch is still withdrawn."""
    for observer in observers:
        try:
            observer.step_failed(fault, start)
        except Exception as error:
            fault.add_note(f"{type(observer).__name__}.step_failed then raised {describe(error)}")


class _Change:
    """``with``: one change of the engine's state (a step, an add, an abort), refused unless the engine is trusted.

    It sets ``engine.busy`` for its duration; when the change raises with ``busy`` still set (nobody restored a
    consistent state, FAULT-4) the engine records why and stays untrusted. It never swallows the exception.
    """

    __slots__ = ("engine", "what")

    def __init__(self, engine: Engine, what: str) -> None:
        self.engine = engine
        self.what = what

    def __enter__(self) -> None:
        self.engine.require_trusted()
        self.engine.busy = self.what

    def __exit__(self, kind: object, error: BaseException | None, trace: object) -> None:
        engine = self.engine
        if error is None:
            engine.busy = None
        elif engine.busy is not None:
            engine.broken_by = describe(error)


class Engine:
    def __init__(self, runner: ModelRunner, config: SchedulerConfig, limits: EngineLimits,
                 observers: Seq[StepObserver] = ()) -> None:
        if limits.scheduling_policy != config.policy:  # POLICY-12: the validator and the scheduler, one policy
            raise ValueError(f"scheduling_policy: the limits' is {limits.scheduling_policy!r}, the scheduler's "
                             f"config's {config.policy!r}: priorities would be refused or silently ignored")
        self.runner = runner
        self.limits = limits
        scheduler = make_scheduler(config)
        assert isinstance(scheduler, Scheduler)  # every policy's class is one (optimized/core/policies.py)
        self.scheduler = scheduler
        self.observers = list(observers)  # told of every change, in order (ARCH-3): the recorder, the shadow
        self.live: dict[int, Request] = {}  # by seq_id
        self.by_arrival: dict[int, Request] = {}  # the same live requests, by arrival
        self.failed: list[Request] = []  # FAULT-1: requests of failed steps, until the caller takes them
        # The change of state in progress ("a step", "an add", "an abort"), None between changes. Still set after
        # the change raised means nobody restored a consistent state (anything but a model fault, FAULT-4): the
        # engine is not to be trusted, and ``broken_by`` says what interrupted it (ENG-11).
        self.busy: str | None = None
        self.broken_by = "an exception"
        self.stats = EngineStats()
        self._arrivals = 0
        self._stepping = _Change(self, "a step")
        self._adding = _Change(self, "an add")
        self._aborting = _Change(self, "an abort")

    @property
    def in_step(self) -> bool:
        """A step began and was neither finished nor failed (FAULT-3); after an exception: untrusted."""
        return self.busy == "a step"

    @property
    def trusted(self) -> bool:
        """No change of state was left half done (ENG-11)."""
        return self.busy is None

    def require_trusted(self) -> None:
        """ENG-11: after a failure inside a step that was not the model's, the state is not to be trusted."""
        if self.busy is not None:
            raise RuntimeError(f"the engine failed inside {self.busy} ({self.broken_by}) and its state is undefined: "
                               "make a new LLM")
        for observer in self.observers:  # TRACE-1: a closed or broken trace refuses the change before it begins
            observer.before_change()

    def add(self, token_ids: Seq[int], params: SamplingParams, seed: int, priority: object = 0) -> Request:
        """Validate and queue one request; refused by the limits, by its priority (POLICY-12) or by an observer
        (the trace's line limit), nothing changes."""
        self.require_trusted()
        ids = validate_request(token_ids, params, self.limits)
        checked = validate_priority(priority, self.limits)
        for observer in self.observers:
            observer.check_add(ids, params)
        return self.add_validated(ids, params, seed, checked)

    def add_validated(self, token_ids: Seq[int], params: SamplingParams, seed: int, priority: int = 0) -> Request:
        """``add`` for a request the caller has already passed through ``validate_request``, ``validate_priority``
        and every observer's ``check_add`` (``LLM`` does all three when it validates)."""
        self.require_trusted()
        request = self._request(token_ids, params, seed, priority)
        with self._adding:
            self.scheduler.add(request.seq, request.stop_ids, request.priority)
            self.live[request.seq.seq_id] = request
            self.by_arrival[request.arrival] = request
            self._arrivals += 1
            for observer in self.observers:
                observer.added(request)
        return request

    def _request(self, token_ids: Seq[int], params: SamplingParams, seed: int, priority: int) -> Request:
        """The next arrival's ``Request``, not yet added anywhere."""
        # Validated once (validate_request): the sequence takes them as an int64 array, unchecked again.
        seq = Sequence(np.asarray(token_ids, dtype=np.int64), params, self.limits.block_size)
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self.limits.eos_token_ids[1:])  # the first is the scheduler's own eos
        # ENG-12: a tiny temperature is greedy, and top_k at or past the vocabulary keeps every token (off).
        temperature = 0.0 if params.greedy else params.temperature
        top_k = -1 if params.top_k >= self.limits.vocab_size else params.top_k
        prompt_logprobs = -1 if params.prompt_logprobs is None or len(token_ids) < 2 else params.prompt_logprobs
        draw = DrawParams(temperature, top_k, params.top_p, seed % (1 << 63),
                          -1 if params.logprobs is None else params.logprobs, prompt_logprobs)
        return Request(self._arrivals, seq, params, draw, frozenset(stops), priority,
                       logprobs=None if params.logprobs is None else [],
                       prompt_logprobs=None if params.prompt_logprobs is None else [None])

    def abort(self, arrival: int, reason: str = "abort") -> Request | None:
        """ABORT-8: abort a live request between steps; None when it has already finished (nothing changes).

        ValueError for an arrival the engine never issued. ``reason`` "stop": a stop string ended it (SERVE-5).
        """
        self.require_trusted()
        self.check_issued(arrival)
        request = self.by_arrival.get(arrival)
        if request is None:
            return None
        with self._aborting:
            self.scheduler.abort(request.seq)
            request.finish_reason = reason
            self._forget(request)
            for observer in self.observers:
                observer.aborted(self.scheduler, request, self.live)
            if reason == "abort":  # a stop string's end is not an abort in the stats
                self.stats.aborted_requests += 1
        return request

    def check_issued(self, arrival: object) -> None:
        """ValueError unless ``arrival`` is a request id this engine issued (ABORT-8)."""
        if not is_strict_int(arrival) or not 0 <= arrival < self._arrivals:
            raise ValueError(f"request_id {arrival!r} is unknown (issued so far: 0..{self._arrivals - 1})")

    def take_failed(self) -> list[Request]:
        """The requests failed steps finished with ``"error"`` since the last call (FAULT-1)."""
        failed, self.failed = self.failed, []
        return failed

    def has_unfinished(self) -> bool:
        return not self.scheduler.is_finished()

    def step(self) -> list[Request]:
        """One scheduler step; the requests that finished in it.

        FAULT-1, FAULT-4: a model fault fails the batch and propagates; any other exception propagates and
        leaves the engine untrusted (``busy`` still set), since it may have struck half-way through a change.
        """
        with self._stepping:
            return self._step()

    def _step(self) -> list[Request]:
        out = self.scheduler.schedule()  # says whom it preempted: no scan of the live requests (OPT-22)
        seqs, is_prefill, live = out.batch, out.is_prefill, self.live
        requests = [live[s.seq_id] for s in seqs]
        observers = self.observers
        for observer in observers:
            observer.scheduled(self.scheduler, out, requests, live)
        start = time.perf_counter()
        try:
            tokens = self.runner.run(seqs, is_prefill, [r.draw for r in requests])
        except BaseException as fault:
            _tell_step_failed(observers, fault, start)
            self._fail_batch_under(fault, seqs, requests)
            raise
        got = self.runner.take_logprobs()
        if got:  # ENG-19: only when a request of the step asked
            for s, r in zip(seqs, requests, strict=True):
                if s.seq_id in got:
                    r.draw = keep(got[s.seq_id], r.logprobs, r.prompt_logprobs, r.draw, s.num_prompt_tokens)
        self._count(out, time.perf_counter() - start)
        finished = [live[s.seq_id] for s in self.scheduler.postprocess(seqs, tokens, is_prefill)]
        for r in finished:
            r.finish_reason = self._finish_reason(r)
            self._forget(r)
        for observer in observers:
            observer.stepped(self.scheduler, tokens, finished, start)
        return finished

    def _fail_batch_under(self, fault: BaseException, seqs: list[Sequence], requests: list[Request]) -> None:
        """FAULT-5: fail the batch for ``fault``; if that raises too, note it on ``fault`` and stay untrusted."""
        try:
            self._fail_batch(seqs, requests)
        except BaseException as second:  # the caller re-raises ``fault``: the second must not replace it
            self.busy = "a step"
            fault.add_note(f"failing the step's batch then raised {describe(second)}; the engine refuses further "
                           "use (make a new LLM)")

    def _fail_batch(self, seqs: list[Sequence], requests: list[Request]) -> None:
        """FAULT-2: withdraw the failed step and abort its batch, in both schedulers; nothing it computed is kept."""
        self.scheduler.abort_step(seqs)
        for r in requests:
            r.finish_reason = "error"
            self._forget(r)
        for observer in self.observers:
            observer.batch_withdrawn(self.scheduler, requests, self.live)
        self.failed.extend(requests)
        self.stats.failed_steps += 1
        self.busy = None  # FAULT-2: consistent again; the fault propagates without marking the engine

    def _forget(self, request: Request) -> None:
        del self.live[request.seq.seq_id]
        del self.by_arrival[request.arrival]

    def _finish_reason(self, r: Request) -> str:
        last = r.seq.last_token
        if last in r.stop_ids or (not r.params.ignore_eos and last == self._eos):
            return "stop"
        return "length"

    @property
    def _eos(self) -> int:
        return self.limits.eos

    def _count(self, out: ScheduleOutput[Sequence], seconds: float) -> None:
        st = self.stats
        seqs = out.batch
        st.steps += 1
        st.preemptions += len(out.preempted)
        computed = sum(s.num_scheduled_tokens for s in seqs)
        if out.is_prefill:
            st.prefill_steps += 1
            st.prefill_tokens += computed
            st.prefill_seconds += seconds
            st.prefix_cache_hit_tokens += out.prefix_hit_tokens
            st.prefix_cache_query_tokens += out.prefix_query_tokens
            st.chunked_prefills += sum(s.num_cached_tokens + s.num_scheduled_tokens < s.num_tokens for s in seqs)
            decodes = sum(not s.is_prefill for s in seqs)
            if decodes:
                st.mixed_steps += 1
                st.mixed_decode_tokens += decodes
        else:
            st.decode_steps += 1
            st.decode_tokens += computed
            st.decode_seconds += seconds
