"""The engine loop in a process of its own (SERVE-2): HTTP work never waits for the engine's GIL, nor it for HTTP's.

Invariants: the engine process owns the ``LLM`` and runs an ``EngineLoop`` in
it; the HTTP process holds an ``EngineProcess``, which keeps every stream it
submitted until that stream's last event has arrived or its client has hung up
(then the engine aborts it, and what is still on its way is dropped). One pipe
joins them, and every message on it is a small frozen dataclass dispatched by
its type (ARCH-7); one of no known type is a defect of ours.
Down go commands, in the order they were given (so a cancel never overtakes its
submit): ``Submit``, ``Cancel``, ``ReadState`` (SERVE-7's probe), ``AbortAll``,
``Stop``. Up come ``Ready`` (or ``NotBuilt``) first, then, in the order the loop
made them: metrics updates (``MetricUpdate``), each send's ``Events`` (keyed by
stream), ``StateAnswer``s, and at most one ``Failed``. The HTTP process writes only
from its sender thread and reads only in its reader thread, so it never stops
reading because a write is blocked: neither side can wait on the other in a
circle. The engine process ignores SIGINT and SIGTERM (the HTTP side drains,
SERVE-8, then says stop) and stops when the pipe closes: a server killed
outright leaves no engine behind. If the engine process ends without being
told to stop, or a message cannot cross the pipe or be carried out (a defect of
ours: the engine process sends ``Failed`` before it stops, so its stop's aborts
are never taken for a clean end), every open stream fails with a 500 and
``failure`` says why, as when the loop fails (SERVE-12). Every message up is
also the engine's heartbeat: while a request is in flight and nothing has come
up for ``step_timeout`` seconds, ``failure`` says the engine is stalled and for
how long, until a message comes again (SERVE-21).
"""

from __future__ import annotations

import functools
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from optimized.engine.sampling_params import SamplingParams
from optimized.entry.llm import EngineState
from optimized.serve.loop import (
    EngineInfo,
    EngineLoop,
    Event,
    FailEvent,
    Stream,
    TokenEvent,
    Unavailable,
    deliver,
    refuse,
)
from optimized.serve.metrics import Metrics, MetricsRecorder, MetricUpdate

log = logging.getLogger("nanoverify.serve")
_STOP_SECONDS = 60  # for the engine process to abort what is left, close its LLM (a trace's flush) and exit
STEP_TIMEOUT_SECONDS = 60.0  # SERVE-21: silence while requests are in flight before the engine is called stalled


# --- down the pipe: the server's commands -----------------------------------------------------------------------
@dataclass(frozen=True)
class Submit:
    key: int  # the stream's name between the two processes
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0  # POLICY-12


@dataclass(frozen=True)
class Cancel:
    key: int


@dataclass(frozen=True)
class ReadState:
    key: int  # the answer's


@dataclass(frozen=True)
class AbortAll:
    pass


@dataclass(frozen=True)
class Stop:
    pass


Command = Submit | Cancel | ReadState | AbortAll | Stop


# --- up the pipe: the engine process's reports (and MetricUpdate) ----------------------------------------------
@dataclass(frozen=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True)
class NotBuilt:
    error: Exception  # what the LLM raised, pickled whole when it can be (``_portable``)


@dataclass(frozen=True)
class Events:
    batch: list[tuple[int, Event]]  # (stream key, event), in the loop's order


@dataclass(frozen=True)
class StateAnswer:
    key: int
    state: EngineState | None
    refused: str | None = None  # why there is no state (the loop stopped or failed)


@dataclass(frozen=True)
class Failed:
    why: str


Report = Ready | NotBuilt | Events | MetricUpdate | StateAnswer | Failed


class EngineProcess:
    """The HTTP side's handle on an engine loop in a spawned process (an ``EngineHandle``)."""

    def __init__(self, llm_kwargs: dict[str, Any], metrics: Metrics,
                 step_timeout: float = STEP_TIMEOUT_SECONDS) -> None:
        """Spawn the engine process and wait until its ``LLM`` is built; what the ``LLM`` raised is raised here.
        ``step_timeout``: SERVE-21's bound (0: never stalled)."""
        context = multiprocessing.get_context("spawn")  # torch's thread pools do not survive a fork
        self._conn, child = context.Pipe()
        # Not a daemon: a daemon may not start processes, and the engine starts tensor-parallel workers.
        self.process = context.Process(target=engine_main, args=(child, llm_kwargs), name="nanoverify-engine")
        self.metrics = metrics
        self._failure: str | None = None  # why the engine is lost for good (SERVE-12)
        self.step_timeout = step_timeout
        self._quiet_since = time.perf_counter()  # the last message up, or the last time nothing was in flight
        self._lock = threading.RLock()  # reentrant: a finalizer's cancel may run while this thread holds it
        self._streams: dict[int, Stream] = {}
        self._states: dict[int, Future[EngineState]] = {}
        self._keys = itertools.count(1)
        self._outbox: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._closing = False  # admit nothing more
        self._stopping = False  # told to stop: the pipe's end is expected
        self._gone = False  # the pipe has closed
        self.process.start()
        child.close()
        try:
            self.info = self._ready()
        except BaseException:
            self._kill()
            raise
        self._reader = threading.Thread(target=self._read, name="nanoverify-engine-reader", daemon=True)
        self._sender = threading.Thread(target=self._write, name="nanoverify-engine-sender", daemon=True)

    def _ready(self) -> EngineInfo:
        try:
            message = self._conn.recv()
        except EOFError:
            self.process.join(10)
            raise RuntimeError(f"the engine process exited with status {self.process.exitcode} before its "
                               "model was loaded") from None
        match message:
            case Ready(info):
                return info
            case NotBuilt(error):  # the LLM refused its options: the same exception here (one line for the CLI)
                self.process.join(10)
                raise error
        raise RuntimeError(f"the engine process sent {type(message).__name__} before saying it was ready")

    @property
    def failure(self) -> str | None:
        """Why the engine serves nothing: lost for good (SERVE-12), or stalled while requests wait (SERVE-21)."""
        return self._failure or self._stalled()

    def _stalled(self) -> str | None:
        if not self.step_timeout or not self._streams:
            return None
        quiet = time.perf_counter() - self._quiet_since
        if quiet <= self.step_timeout:
            return None
        return (f"the engine process has not finished a step for {quiet:.1f} s while {len(self._streams)} "
                f"requests are in flight (the bound is {self.step_timeout:g} s, --step-timeout): it is stalled")

    # --- the HTTP side's calls ------------------------------------------------------------------------
    def start(self) -> None:
        """Start reading and writing the pipe (once; a later call does nothing)."""
        if self._reader.ident is None:
            self._reader.start()
            self._sender.start()

    def submit(self, stream: Stream) -> None:
        """Send ``stream`` for admission; Unavailable when closing, failed or gone."""
        with self._lock:
            if self._closing or self.failure is not None or self._gone:
                raise Unavailable(self.failure or "the server is shutting down")
            if not self._streams:  # the engine was idle: its silence so far is no stall
                self._quiet_since = time.perf_counter()
            stream.key = next(self._keys)
            self._streams[stream.key] = stream
        self._outbox.put(Submit(stream.key, stream.prompt_ids, stream.params, stream.priority))

    def cancel(self, stream: Stream) -> None:
        """The client went away: the engine aborts the request at its next gap between steps (SERVE-7). Nobody
        waits for the stream any more: it is forgotten here at once (events still on their way are dropped)."""
        with self._lock:
            if stream.cancelled or stream.done or self._streams.pop(stream.key, None) is None:
                return
            stream.cancelled = stream.done = True
        self._outbox.put(Cancel(stream.key))

    def engine_state(self) -> Future[EngineState]:
        """SERVE-7: the engine's state between two steps, read in the engine process."""
        future: Future[EngineState] = Future()
        with self._lock:
            if self._stopping or self.failure is not None or self._gone:
                future.set_exception(Unavailable(self.failure or "the engine loop is not running"))
                return future
            key = next(self._keys)
            self._states[key] = future
        self._outbox.put(ReadState(key))
        return future

    def alive(self) -> bool:
        return not self._gone and self.process.is_alive()

    def in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def close(self) -> None:
        """Admit nothing more (SERVE-8); live requests go on."""
        with self._lock:
            self._closing = True

    def abort_all(self) -> None:
        """Abort every live request at the engine's next gap between steps."""
        with self._lock:
            self._closing = True
        self._outbox.put(AbortAll())

    def stop(self, timeout: float = _STOP_SECONDS) -> None:
        """Abort what is left, let the engine process close its ``LLM`` and exit (killed after ``timeout``).
        Idempotent."""
        with self._lock:
            if self._stopping:
                return
            self._closing = self._stopping = True
        self._outbox.put(Stop())
        self._outbox.put(None)
        if self._sender.ident is None:  # never started: say stop directly
            self._write()
        self.process.join(timeout)
        if self.process.is_alive():
            log.warning("the engine process did not stop within %.0f s and is killed", timeout)
            self._kill()
            with self._lock:
                self._failure = self._failure or f"the engine process did not stop within {timeout:g} s"
            self.metrics.lost()  # SERVE-20: killed, it runs nothing any more
        if self._reader.ident is not None:
            self._reader.join(10)  # the engine process is gone, so the pipe has ended
        self._conn.close()
        self._fail_rest(503, "the server is shutting down")

    def _kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    # --- the pipe ---------------------------------------------------------------------------------------
    def _write(self) -> None:
        """Send every command until told to stop. One that cannot be sent (a defect of ours: it does not pickle)
        ends trust like ``_untrusted``; submits still queued then are dropped, and stop still goes."""
        while (command := self._outbox.get()) is not None:
            if isinstance(command, Submit) and self._failure is not None:
                continue  # its stream has failed already
            try:
                self._conn.send(command)
            except OSError:  # the engine process is gone: the reader says so
                return
            except Exception as e:
                self._untrusted(f"the server could not send {type(command).__name__} to the engine process "
                                f"({type(e).__name__}: {e})")

    def _read(self) -> None:
        """Take every message until the pipe ends. One that cannot be read or taken (a defect of ours) ends trust
        (``_untrusted``), and the pipe is still drained, so the engine process never blocks writing and still
        stops when told."""
        trusted = True
        while True:
            try:
                message = self._conn.recv()
                self._quiet_since = time.perf_counter()
                if trusted:
                    self._take(message)
            except (EOFError, OSError):  # the engine process has ended
                break
            except Exception as e:  # the message was read whole: the next one is intact
                if trusted:
                    trusted = False
                    self._untrusted(f"the server could not take a message from the engine process "
                                    f"({type(e).__name__}: {e})")
        self._gone = True
        if not self._stopping:
            self.process.join(5)
            status = "" if self.process.exitcode is None else f" (exit status {self.process.exitcode})"
            self._fail(f"the engine process ended unexpectedly{status}; the engine is no longer trusted")
            log.error("%s", self.failure)

    def _untrusted(self, why: str) -> None:
        """A defect of ours broke the pipe's protocol: every stream fails with a 500 (SERVE-12), nothing more is
        admitted, and the engine is told to abort what it runs (nobody waits for it any more)."""
        self._fail(f"{why}; the engine is no longer trusted")
        log.error("%s", self.failure)
        self._outbox.put(AbortAll())

    def _take(self, message: Report) -> None:
        match message:
            case Events(batch):
                self._dispatch(batch)
            case MetricUpdate():
                self.metrics.apply(message)
            case StateAnswer(key, state, refused):
                self._answer(key, state, refused)
            case Failed(why):
                self._fail(why)
            case _:  # Ready again, or no message of ours
                raise TypeError(f"not a message the server takes now: {type(message).__name__}")

    def _dispatch(self, batch: list[tuple[int, Event]]) -> None:
        events: list[tuple[Stream, Event]] = []
        with self._lock:
            for key, event in batch:
                stream = self._streams.get(key)
                if stream is None:  # failed here already
                    continue
                if not isinstance(event, TokenEvent):
                    del self._streams[key]
                    stream.done = True
                events.append((stream, event))
        deliver(events)

    def _answer(self, key: int, state: EngineState | None, refused: str | None) -> None:
        with self._lock:
            future = self._states.pop(key, None)
        if future is None:
            return
        if state is None:
            refuse(future, refused or "no state")
        elif future.set_running_or_notify_cancel():  # not cancelled by its caller
            future.set_result(state)

    def _fail(self, why: str) -> None:
        """SERVE-12: the engine is no longer trusted: every open stream fails with a 500."""
        with self._lock:
            if self._failure is None:
                self._failure = why
        self.metrics.lost()  # SERVE-20: nothing runs or waits any more
        self._fail_rest(500, why)

    def _fail_rest(self, status: int, why: str) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
            states = list(self._states.values())
            self._states.clear()
            for stream in streams:
                stream.done = True
        deliver([(stream, FailEvent(status, why)) for stream in streams])
        for future in states:
            refuse(future, why)


# --- the engine process ----------------------------------------------------------------------------------
class PipeOutlet:
    """The loop's events, keyed by stream, up the pipe; a stream's last event forgets it."""

    def __init__(self, send: Callable[[Report], None], streams: dict[int, Stream], lock: threading.Lock) -> None:
        self._send = send
        self._streams = streams
        self._lock = lock

    def send(self, events: list[tuple[Stream, Event]]) -> None:
        if not events:
            return
        with self._lock:
            for stream, event in events:
                if not isinstance(event, TokenEvent):
                    self._streams.pop(stream.key, None)
        self._send(Events([(stream.key, event) for stream, event in events]))

    def failed(self, why: str) -> None:
        self._send(Failed(why))


def engine_main(conn: Connection, llm_kwargs: dict[str, Any]) -> None:
    """The engine process: build the ``LLM``, say ready (or why not), obey the pipe until stop or its end."""
    for number in (signal.SIGINT, signal.SIGTERM):  # the server's signals are the HTTP side's to handle
        signal.signal(number, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sending = threading.Lock()
    server_gone = threading.Event()

    def send(message: Report) -> None:
        """Up the pipe; once the server is gone, nothing (the main thread sees the pipe's end and stops)."""
        with sending:
            if server_gone.is_set():
                return
            try:
                conn.send(message)
            except (BrokenPipeError, ConnectionResetError):
                server_gone.set()

    from optimized.entry.llm import LLM

    try:
        llm = LLM(**llm_kwargs)
    except Exception as e:
        send(NotBuilt(_portable(e)))
        return
    streams: dict[int, Stream] = {}
    lock = threading.Lock()
    from optimized.parallel.launch import group_fault

    parallel = int(llm_kwargs.get("tensor_parallel_size") or 1) > 1  # SERVE-19: only a group has workers to watch
    loop = EngineLoop(llm, MetricsRecorder(send), PipeOutlet(send, streams, lock),
                      watch=group_fault if parallel else None)
    try:
        send(Ready(EngineInfo.of(llm)))
        loop.start()
        _obey(conn, loop, send, streams, lock)
    except BaseException as error:  # SERVE-12: the server fails what is in flight (500) before the stop aborts it
        send(Failed(f"the engine process could not carry out the server's commands ({type(error).__name__}: "
                    f"{error}); the engine is no longer trusted"))
        raise
    finally:
        loop.stop(timeout=_STOP_SECONDS)
        llm.close()  # a trace flushed, tensor-parallel workers stopped


def _portable(error: Exception) -> Exception:
    """``error`` if it survives pickling whole, else a RuntimeError that names it."""
    try:
        copy = pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return copy if isinstance(copy, Exception) and str(copy) == str(error) else RuntimeError(
        f"{type(error).__name__}: {error}")


def _obey(conn: Connection, loop: EngineLoop, send: Callable[[Report], None], streams: dict[int, Stream],
          lock: threading.Lock) -> None:
    """Carry out the server's commands until ``Stop`` or the pipe's end; a message of no known type is a
    TypeError (a defect of ours), which ends the engine process after telling the server (``Failed``), which fails
    what is in flight with a 500."""
    while True:
        try:
            command = conn.recv()
        except (EOFError, OSError):
            return
        match command:
            case Submit(key, prompt_ids, params, priority):
                stream = Stream(prompt_ids, params, key=key, priority=priority)
                with lock:
                    streams[key] = stream
                try:
                    loop.submit(stream)
                except Unavailable:  # the loop failed: the server fails the stream when Failed arrives
                    with lock:
                        streams.pop(key, None)
            case Cancel(key):
                with lock:
                    found = streams.pop(key, None)
                if found is not None:
                    loop.cancel(found)
            case ReadState(key):
                loop.engine_state().add_done_callback(functools.partial(_answer_state, send, key))
            case AbortAll():
                loop.abort_all()
            case Stop():
                return
            case _:
                raise TypeError(f"not a command of the server's: {type(command).__name__}")


def _answer_state(send: Callable[[Report], None], key: int, future: Future[EngineState]) -> None:
    error = future.exception()
    send(StateAnswer(key, future.result()) if error is None else StateAnswer(key, None, str(error)))
