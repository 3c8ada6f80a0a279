"""A conformance workload run through the reference, recorded as a trace (TRACE-8).

Invariant: the run is CONF-2's replay loop itself (``conformance.replay``),
watched by a recorder: each arrival is recorded before the step it precedes,
each step record is CONF-3's record of the same workload plus the tokens
handed to postprocess, and the empty decode ends the trace where it ends the
loop's. A workload without a recorded run can so be replayed and drawn like
any recorded one.
"""

from __future__ import annotations

import io
from typing import Any

from optimized.core.config import SchedulerConfig
from optimized.core.port import SchedulerPort
from optimized.trace.recorder import Recorder
from optimized.trace.schema import Trace, read_trace
from optimized.verify.conformance import ReplayWatcher, Request, Workload, implementation, replay


class _Recording(ReplayWatcher):
    """Writes each arrival and step of the replay loop to ``recorder``."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def added(self, step: int, request: Request) -> None:
        self.recorder.at_step(step)
        self.recorder.add(request.id, request.prompt, request.max_tokens, request.ignore_eos, request.priority)

    def stepped(self, port: SchedulerPort[Any], record: dict[str, Any], tokens: list[int]) -> None:
        recorder = self.recorder
        recorder.at_step(record["step"])
        if "error" in record:  # the lesson's ``assert scheduled_seqs`` (EDGE-2)
            recorder.empty_decode()
            return
        entries = [(rid, tokens_granted, table) for rid, tokens_granted, table in record["batch"]]
        decided = recorder.decided(record["prefill"], entries, record["preempted"])
        recorder.step(decided, tokens, record["finished"])


def record_workload(workload: Workload) -> str:
    """The trace text of ``workload`` run through the reference scheduler."""
    out = io.StringIO()
    config = SchedulerConfig(**workload.config)
    replay(workload, implementation("reference"), watcher=_Recording(Recorder(out, config, [config.eos])))
    return out.getvalue()


def workload_trace(workload: Workload) -> Trace:
    return read_trace(record_workload(workload).encode().splitlines(keepends=True))
