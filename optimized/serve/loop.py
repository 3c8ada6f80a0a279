"""The engine loop: one thread owns the ``LLM`` and is the only caller into it (SERVE-2, SERVE-3).

Invariants: HTTP handlers never call the engine. They hand a ``Stream`` to
``submit`` and mark it with ``cancel``; the loop admits arrivals and applies
cancellations between steps (a cancelled request is aborted before the next
step runs, ABORT-8, so its blocks are free again), steps while any request is
live and otherwise sleeps on a condition. After each step every live stream is
sent the tokens it gained (``TokenEvent``), and every finished one its output
(``FinishEvent``), through the loop's ``Outlet``: by default straight onto each
stream's asyncio queue (``call_soon_threadsafe``), in the server through the
pipe to the HTTP process (engine_process.py); a stream's events are in order
and end with exactly one ``FinishEvent`` or ``FailEvent``. When the engine can no longer be trusted (check mode's
``ShadowDivergence``, ENG-22; any failure that leaves it untrusted, ENG-11)
the loop records why in ``failure``, logs it (both schedulers' states, for a
divergence), fails every stream with a 500 that says so and stops: nothing is
admitted after (SERVE-12), no probe is taken, and every probe not answered
fails when the loop ends; a ``watch`` that says the engine can no longer step (a
dead tensor-parallel worker, SERVE-19) ends it the same way. The metrics' gauges
are published after every step and every turn that admitted or aborted
(SERVE-13), and drop to 0 when the loop fails (SERVE-20). The loop knows the engine
only through ``LLM``'s request and read API (ARCH-5). A request is validated
once, by its handler (ARCH-6): the loop admits it with ``LLM.add_validated``,
which checks only trust and the trace's writability.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from optimized.engine.model_runner import CollectiveError
from optimized.engine.sampling_params import Logprob, SamplingParams
from optimized.engine.validation import EngineLimits
from optimized.entry.llm import LLM, EngineState, RequestOutput
from optimized.serve.metrics import EngineMetrics
from optimized.verify.shadow import ShadowDivergence

log = logging.getLogger("nanoverify.serve")


@dataclass(frozen=True)
class TokenEvent:
    """Times are ``time.perf_counter()``: CLOCK_MONOTONIC on Linux, one clock for every process of the machine."""

    tokens: list[int]
    at: float  # when the loop sent them
    scheduled: float  # when the first step that computed the request began (SERVE-13's queue time ends there)
    logprobs: list[dict[int, Logprob]] | None = None  # the tokens' logprobs, when the request asked (SERVE-6)


@dataclass(frozen=True)
class FinishEvent:
    output: RequestOutput
    at: float


@dataclass(frozen=True)
class FailEvent:
    status: int
    message: str


Event = TokenEvent | FinishEvent | FailEvent


@dataclass(eq=False)
class Stream:
    """One request's channel from the engine loop to its HTTP handler.

    ``loop`` and ``queue`` are the handler's; in the engine process a stream has neither, only the ``key`` its
    events travel back under."""

    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    key: int = 0  # the stream's name between the two processes
    priority: int = 0  # the request's (POLICY-12), validated by its handler
    request_id: int | None = None
    sent: int = 0  # completion tokens sent so far
    scheduled_at: float | None = None  # when the first step that computed it began (SERVE-13)
    cancelled: bool = False
    done: bool = False  # its last event (output or failure) is sent


def deliver(events: list[tuple[Stream, Event]]) -> None:
    """Put ``events`` on their streams' queues, with one wake-up per event loop (from another thread)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, Event]]] = {}
    for stream, event in events:
        if stream.loop is not None:
            by_loop.setdefault(stream.loop, []).append((stream, event))
    for loop, batch in by_loop.items():

        def put_all(batch: list[tuple[Stream, Event]] = batch) -> None:
            for stream, event in batch:
                stream.queue.put_nowait(event)

        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening any more
            loop.call_soon_threadsafe(put_all)


def _scheduled(stream: Stream, step_started: float) -> float:
    return stream.scheduled_at if stream.scheduled_at is not None else step_started


class Outlet(Protocol):
    """Where the loop's events go: ``send`` a turn's events in order; ``failed``: the loop stopped for good."""

    def send(self, events: list[tuple[Stream, Event]]) -> None: ...

    def failed(self, why: str) -> None: ...


class QueueOutlet:
    """Events straight onto the streams' asyncio queues (the loop and its handlers in one process)."""

    def send(self, events: list[tuple[Stream, Event]]) -> None:
        deliver(events)

    def failed(self, why: str) -> None:
        """Nothing to tell: the handlers read ``EngineLoop.failure`` themselves."""


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP side needs of the engine to check requests: its fixed limits and its checkpoint folder."""

    limits: EngineLimits
    model_dir: Path
    traced: bool = False  # a trace records the run: a request must also fit its add record (TRACE-4)

    @staticmethod
    def of(llm: LLM) -> EngineInfo:
        return EngineInfo(llm.limits, llm.model_dir, llm.traced)


class EngineHandle(Protocol):
    """The HTTP side's view of the engine loop, in this process (``EngineLoop``) or another (``EngineProcess``)."""

    @property
    def failure(self) -> str | None:
        """Why the engine serves nothing now: no longer trusted (SERVE-12), or stalled (SERVE-21)."""

    def start(self) -> None: ...

    def submit(self, stream: Stream) -> None: ...

    def cancel(self, stream: Stream) -> None: ...

    def engine_state(self) -> Future[EngineState]: ...

    def alive(self) -> bool: ...

    def in_flight(self) -> int: ...

    def close(self) -> None: ...

    def abort_all(self) -> None: ...

    def stop(self) -> None: ...


class Unavailable(Exception):
    """The loop admits nothing: shutting down, or the engine is no longer trusted."""


class EngineLost(Exception):
    """``EngineLoop.watch`` found that the engine can no longer step (SERVE-19); the text says why."""


def refuse(future: Future[Any], why: str) -> None:
    """Fail ``future`` with Unavailable, unless its caller has cancelled it already."""
    if future.set_running_or_notify_cancel():
        future.set_exception(Unavailable(why))


WATCH_SECONDS = 0.5  # SERVE-19: how often an idle loop asks ``watch`` whether the engine can still step


class EngineLoop:
    def __init__(self, llm: LLM, metrics: EngineMetrics, outlet: Outlet | None = None,
                 watch: Callable[[], str | None] | None = None) -> None:
        """``watch``: asked at every turn and every ``WATCH_SECONDS`` while idle, from the loop's thread; a text
        (why the engine can no longer step: a tensor-parallel worker died, SERVE-19) ends the loop as
        ``_die`` does."""
        self.llm = llm
        self.metrics = metrics
        self.outlet: Outlet = outlet or QueueOutlet()
        self.watch = watch
        self.failure: str | None = None  # why the engine is no longer trusted (SERVE-12)
        self._cv = threading.Condition()
        self._arrivals: list[Stream] = []
        self._hangups: list[Stream] = []
        self._probes: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._live: dict[int, Stream] = {}
        self._unscheduled: list[Stream] = []  # admitted, not computed by any step yet
        self._closing = False  # admit nothing more
        self._abort_all = False  # abort every live request, then keep serving nothing
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="nanoverify-engine-loop", daemon=True)

    # --- called from the HTTP side --------------------------------------------------------------
    def start(self) -> None:
        """Start the loop's thread (once; a later call does nothing)."""
        if self.thread.ident is None:
            self.thread.start()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def submit(self, stream: Stream) -> None:
        """Queue ``stream`` for admission at the next gap between steps; Unavailable when closing or failed."""
        with self._cv:
            if self._closing or self.failure is not None or not self.thread.is_alive():
                raise Unavailable(self.failure or "the server is shutting down")
            self._arrivals.append(stream)
            self._cv.notify()

    def cancel(self, stream: Stream) -> None:
        """The client went away: abort the request before the next step (SERVE-7)."""
        with self._cv:
            if not stream.cancelled and not stream.done:
                stream.cancelled = True
                self._hangups.append(stream)
                self._cv.notify()

    def call_between_steps(self, probe: Callable[[], Any]) -> Future[Any]:
        """Run ``probe`` in the loop thread between two steps; its result through the future."""
        future: Future[Any] = Future()
        with self._cv:  # a stopping or failed loop may take no more probes: none would be answered
            if self._stop or self.failure is not None or not self.thread.is_alive():
                future.set_exception(Unavailable(self.failure or "the engine loop is not running"))
                return future
            self._probes.append((probe, future))
            self._cv.notify()
        return future

    def engine_state(self) -> Future[EngineState]:
        """SERVE-7: ``LLM.engine_state`` read between two steps."""
        return self.call_between_steps(self.llm.engine_state)

    def in_flight(self) -> int:
        with self._cv:
            return len(self._live) + len(self._arrivals)

    def close(self) -> None:
        """Admit nothing more (SERVE-8); live requests go on."""
        with self._cv:
            self._closing = True

    def abort_all(self) -> None:
        """Abort every live request at the next gap (the shutdown grace period is over)."""
        with self._cv:
            self._closing = self._abort_all = True
            self._cv.notify()

    def stop(self, timeout: float = 5.0) -> None:
        """Abort what is left and end the thread."""
        with self._cv:
            self._closing = self._abort_all = self._stop = True
            self._cv.notify()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    # --- the loop thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._turn():
                pass
        except BaseException as error:  # every way out of the loop must fail the streams
            self._die(error)
        finally:
            self._refuse_probes("the engine loop stopped")

    def _refuse_probes(self, why: str) -> None:
        """Fail every probe not answered: no turn will come for them."""
        with self._cv:
            probes, self._probes = self._probes, []
        for _, future in probes:
            refuse(future, why)

    def _turn(self) -> bool:
        """Apply what the handlers asked, then one step if anything is live; False when told to stop."""
        with self._cv:
            while not (self._arrivals or self._hangups or self._probes or self._live or self._stop
                       or self._abort_all):
                if self.watch is None:
                    self._cv.wait()
                elif not self._cv.wait(WATCH_SECONDS):
                    break  # idle a while: ``watch`` is asked below, outside the lock
            arrivals, self._arrivals = self._arrivals, []
            hangups, self._hangups = self._hangups, []
            probes, self._probes = self._probes, []
            abort_all, stop = self._abort_all, self._stop
            self._abort_all = False  # done below; admission stays closed, so nothing new comes to abort
        if self.watch is not None and (fault := self.watch()) is not None:
            raise EngineLost(fault)
        for stream in arrivals:
            self._admit(stream)
        for stream in hangups:
            self._abort(stream)
        if abort_all:
            for stream in list(self._live.values()):
                self._abort(stream, tell=True)
        if arrivals or hangups or abort_all:
            self._publish()  # admissions and aborts change the gauges too, step or no step (probes see them)
        for probe, future in probes:
            self._answer(probe, future)
        if stop:
            if self._live:  # only finished requests are left (all else was aborted): their outputs are due
                self._step()
            return False
        if self._live or self.llm.has_unfinished_requests():  # FAULT-1's outputs come with a step, too
            self._step()
        return True

    def _admit(self, stream: Stream) -> None:
        if stream.cancelled:
            return
        stream.request_id = self.llm.add_validated(stream.prompt_ids, stream.params,  # SERVE-9 checked them
                                                   stream.priority)
        self._live[stream.request_id] = stream
        self._unscheduled.append(stream)
        self.metrics.admitted(len(stream.prompt_ids))

    def _abort(self, stream: Stream, tell: bool = False) -> None:
        """Abort the stream's request if it is live; ``tell``: send the handler the aborted output.

        A request that has finished already (a failed step's, FAULT-1) keeps its stream: its output comes with the
        next step and goes to it then."""
        if stream.request_id is None or stream.request_id not in self._live:
            return
        output = self.llm.abort(stream.request_id)
        if output is None:
            return
        del self._live[stream.request_id]
        self._count_finish(output)
        if tell:
            self._send_rest(stream, output)

    @staticmethod
    def _answer(probe: Callable[[], Any], future: Future[Any]) -> None:
        if not future.set_running_or_notify_cancel():  # its caller stopped waiting (a cancelled handler)
            return
        try:
            future.set_result(probe())
        except Exception as e:  # the probe's own failure goes to its caller
            future.set_exception(e)

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            outputs = self.llm.step()
        except Exception as e:
            if isinstance(e, ShadowDivergence | CollectiveError) or not self.llm.trusted:
                raise  # a collective's failure leaves the tensor-parallel group dead (TP-9): no step can run again
            log.error("a step failed and its batch ended with an error (FAULT-1): %s", e)
            self._publish()
            return  # the failed requests' outputs (finish_reason "error") come with the next step
        if self._unscheduled:
            self._note_scheduled(started)
        now = time.perf_counter()
        finished = {o.request_id for o in outputs}
        events: list[tuple[Stream, Event]] = []
        generated = 0
        for rid, stream in self._live.items():
            if rid not in finished:
                tokens = self.llm.completion_tokens(rid, stream.sent)
                if tokens:
                    logprobs = None if stream.params.logprobs is None else self.llm.completion_logprobs(rid,
                                                                                                     stream.sent)
                    stream.sent += len(tokens)
                    generated += len(tokens)
                    events.append((stream, TokenEvent(tokens, now, _scheduled(stream, started), logprobs)))
        for output in outputs:
            self._count_finish(output)
            owner = self._live.pop(output.request_id, None)
            if owner is None:  # defensive: every output has a live stream (_abort keeps one whose output is due)
                continue
            generated += len(output.token_ids) - owner.sent
            events += [(owner, event) for event in self._last_events(owner, output, started)]
        self.metrics.generated(generated)  # before the events: a client that sees its end sees it counted
        self.outlet.send(events)  # one send per step, not one per request
        self._publish()

    def _note_scheduled(self, started: float) -> None:
        """SERVE-13: the streams this step (begun at ``started``) computed first: those given blocks, or gone."""
        waiting = []
        for stream in self._unscheduled:
            if stream.request_id is None or self.llm.started(stream.request_id):
                stream.scheduled_at = started
            else:
                waiting.append(stream)
        self._unscheduled = waiting

    def _send_rest(self, stream: Stream, output: RequestOutput) -> None:
        self.metrics.generated(len(output.token_ids) - stream.sent)
        self.outlet.send([(stream, e) for e in self._last_events(stream, output, time.perf_counter())])

    @staticmethod
    def _last_events(stream: Stream, output: RequestOutput, started: float) -> list[Event]:
        """The tokens not sent yet (if any), then the output."""
        now = time.perf_counter()
        events: list[Event] = []
        if len(output.token_ids) > stream.sent:
            logprobs = None if output.logprobs is None else output.logprobs[stream.sent :]
            events.append(TokenEvent(output.token_ids[stream.sent :], now, _scheduled(stream, started), logprobs))
            stream.sent = len(output.token_ids)
        events.append(FinishEvent(output, now))
        stream.done = True
        return events

    def _count_finish(self, output: RequestOutput) -> None:
        self.metrics.finished(output.finish_reason)

    def _publish(self) -> None:
        """The engine's gauges and counters, as they are now (after a step, or a turn that changed them)."""
        self.metrics.after_step(self.llm.stats, self.llm.gauges())

    def _die(self, error: BaseException) -> None:
        """SERVE-12: the engine is untrusted: say why, fail every stream with a 500, admit nothing more."""
        if isinstance(error, ShadowDivergence):  # found by a step or by an abort's mirror
            self.metrics.diverged()
            why = "check mode found the engine's scheduler diverging from the reference scheduler"
        elif isinstance(error, EngineLost | CollectiveError):
            why = f"the tensor-parallel group is dead ({error})"
        else:
            why = f"the engine loop failed ({type(error).__name__}: {error})"
        log.error("%s; the engine is no longer trusted and the server admits nothing more:\n%s", why, error)
        with self._cv:
            self.failure = f"{why}; the engine is no longer trusted"
            self._closing = True
            streams = list(self._live.values()) + self._arrivals
            self._live.clear()
            self._arrivals.clear()
            probes, self._probes = self._probes, []
        for stream in streams:
            stream.done = True
        self.metrics.lost()  # SERVE-20: nothing runs or waits any more
        self.outlet.send([(stream, FailEvent(500, self.failure)) for stream in streams])
        self.outlet.failed(self.failure)
        for _, future in probes:
            refuse(future, self.failure)
