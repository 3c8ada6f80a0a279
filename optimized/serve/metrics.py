"""Prometheus metrics of one server, in a registry of its own (SERVE-13).

Invariant: names follow vLLM's where the meaning is the same, with the
``nanoverify:`` prefix; counters only grow. Engine counters are advanced by the
engine loop (through ``EngineMetrics``) after each step from the difference of
``EngineStats`` (so they agree with the engine exactly); request histograms are
observed by the HTTP handlers as tokens arrive. In the server the engine loop
runs in a process of its own: ``MetricsRecorder`` carries its calls over to
this process's ``Metrics``, in order, as typed messages (``MetricUpdate``: one
small frozen dataclass per call, ARCH-7) that ``Metrics.apply`` dispatches by
type. A separate ``CollectorRegistry`` keeps two servers in one process (tests)
from sharing series.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from optimized.engine.engine import EngineStats
    from optimized.entry.llm import Gauges

PREFIX = "nanoverify:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class EngineMetrics(Protocol):
    """What the engine loop reports: admitted prompt tokens, generated tokens, finishes, a divergence, the
    engine's state after a step or a turn that changed it, and its loss (SERVE-20)."""

    def admitted(self, prompt_tokens: int) -> None: ...

    def generated(self, tokens: int) -> None: ...

    def finished(self, reason: str) -> None: ...

    def diverged(self) -> None: ...

    def after_step(self, stats: EngineStats, gauges: Gauges) -> None: ...

    def lost(self) -> None: ...


@dataclass(frozen=True)
class MetricUpdate:
    """One ``EngineMetrics`` call, as it crosses the pipe (ARCH-7)."""


@dataclass(frozen=True)
class Admitted(MetricUpdate):
    prompt_tokens: int


@dataclass(frozen=True)
class Generated(MetricUpdate):
    tokens: int


@dataclass(frozen=True)
class Finished(MetricUpdate):
    reason: str


@dataclass(frozen=True)
class Diverged(MetricUpdate):
    pass


@dataclass(frozen=True)
class Lost(MetricUpdate):
    pass


@dataclass(frozen=True)
class AfterStep(MetricUpdate):
    stats: EngineStats  # a copy: the engine's own goes on counting
    gauges: Gauges


class MetricsRecorder:
    """An ``EngineMetrics`` that hands each call to ``send`` as a ``MetricUpdate`` (``Metrics.apply`` replays it)."""

    def __init__(self, send: Callable[[MetricUpdate], None]) -> None:
        self._send = send

    def admitted(self, prompt_tokens: int) -> None:
        self._send(Admitted(prompt_tokens))

    def generated(self, tokens: int) -> None:
        self._send(Generated(tokens))

    def finished(self, reason: str) -> None:
        self._send(Finished(reason))

    def diverged(self) -> None:
        self._send(Diverged())

    def after_step(self, stats: EngineStats, gauges: Gauges) -> None:
        self._send(AfterStep(copy.copy(stats), gauges))

    def lost(self) -> None:
        self._send(Lost())


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge(PREFIX + "num_requests_running", "Requests in the running queue.", registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests in the waiting queue.", registry=r)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).",
                              registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens admitted.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=r)
        self.preemptions = Counter(PREFIX + "num_preemptions", "Preemptions.", registry=r)
        self.prefix_queries = Counter(PREFIX + "prefix_cache_queries", "Tokens looked up in the prefix cache.",
                                      registry=r)
        self.prefix_hits = Counter(PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   registry=r)
        self.success = Counter(PREFIX + "request_success", "Requests finished, by finish reason.",
                               ["finished_reason"], registry=r)
        self.compared_steps = Counter(PREFIX + "check_compared_steps",
                                      "Steps check mode compared with the reference scheduler.", registry=r)
        self.divergences = Counter(PREFIX + "check_divergences", "Divergences check mode found (0 or 1).", registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between two token deliveries.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds",
                                    "Arrival to the start of the step that computed the request first.",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self._seen: dict[str, int] = {}

    def advance(self, counter: Counter, name: str, total: int) -> None:
        """Move ``counter`` up to the engine's running ``total`` (named ``name``)."""
        delta = total - self._seen.get(name, 0)
        if delta > 0:
            counter.inc(delta)
            self._seen[name] = total

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def generated(self, tokens: int) -> None:
        self.generation_tokens.inc(tokens)

    def finished(self, reason: str) -> None:
        self.success.labels(finished_reason=reason).inc()

    def diverged(self) -> None:
        self.divergences.inc()

    def apply(self, update: MetricUpdate) -> None:
        """Replay one ``MetricsRecorder`` call; an update of no known type is a TypeError (a defect of ours)."""
        match update:
            case Admitted(prompt_tokens):
                self.admitted(prompt_tokens)
            case Generated(tokens):
                self.generated(tokens)
            case Finished(reason):
                self.finished(reason)
            case Diverged():
                self.diverged()
            case AfterStep(stats, gauges):
                self.after_step(stats, gauges)
            case Lost():
                self.lost()
            case _:
                raise TypeError(f"not a metrics update: {update!r}")

    def after_step(self, stats: EngineStats, gauges: Gauges) -> None:
        """The engine's gauges and counters after a step (called by the engine loop only)."""
        self.running.set(gauges.running)
        self.waiting.set(gauges.waiting)
        self.kv_usage.set(1 - gauges.free_blocks / gauges.num_blocks)
        self.advance(self.preemptions, "preemptions", stats.preemptions)
        self.advance(self.prefix_queries, "prefix_queries", stats.prefix_cache_query_tokens)
        self.advance(self.prefix_hits, "prefix_hits", stats.prefix_cache_hit_tokens)
        self.advance(self.compared_steps, "compared_steps", stats.compared_steps)

    def lost(self) -> None:
        """SERVE-20: the engine is gone or no longer trusted: nothing runs, waits or holds a block any more (the
        counters keep what was counted)."""
        self.running.set(0)
        self.waiting.set(0)
        self.kv_usage.set(0)

    def text(self) -> bytes:
        return generate_latest(self.registry)
