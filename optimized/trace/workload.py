"""A conformance workload run through the reference, recorded as a trace (TRACE-8).

Invariant: the run is CONF-2's replay loop exactly (arrivals before each
``schedule()`` in ``(arrive, id)`` order, the step jumping to the next arrival
while idle, each scheduled sequence given ``output[num_completion_tokens]``),
so the trace's decisions are CONF-3's records of the same workload, plus the
tokens handed to postprocess. A workload without a recorded run can so be
replayed and drawn like any recorded one.
"""

from __future__ import annotations

import io

import reference
from optimized.trace.recorder import Recorder
from optimized.trace.schema import Trace, read_trace
from optimized.verify.conformance import Request, Workload


def record_workload(workload: Workload) -> str:
    """The trace text of ``workload`` run through the reference scheduler."""
    out = io.StringIO()
    config = reference.SchedulerConfig(**workload.config)
    scheduler = reference.Scheduler(config)
    recorder = Recorder(out, config, [config.eos])
    pending = sorted(workload.requests, key=lambda r: (r.arrive, r.id))
    request_of: dict[int, Request] = {}
    step = 0
    while pending or not scheduler.is_finished():
        while pending and pending[0].arrive <= step:
            r = pending.pop(0)
            seq = reference.Sequence(r.prompt, reference.SamplingParams(max_tokens=r.max_tokens,
                                                                         ignore_eos=r.ignore_eos), config.block_size)
            request_of[seq.seq_id] = r
            recorder.at_step(step)
            recorder.add(r.id, r.prompt, r.max_tokens, r.ignore_eos)
            scheduler.add(seq)
        if scheduler.is_finished():
            step = pending[0].arrive
            continue
        recorder.at_step(step)
        running_before = {s.seq_id for s in scheduler.running}
        try:
            batch, prefill = scheduler.schedule()
        except AssertionError:  # the lesson's ``assert scheduled_seqs`` (EDGE-2)
            recorder.empty_decode()
            break
        preempted = [request_of[i].id for i in running_before & {s.seq_id for s in scheduler.waiting}]
        ids = [request_of[s.seq_id].id for s in batch]
        decided = recorder.decided(prefill, [(i, s.num_scheduled_tokens, s.block_table)
                                             for i, s in zip(ids, batch, strict=True)], preempted)
        tokens = [request_of[s.seq_id].output[s.num_completion_tokens] for s in batch]
        scheduler.postprocess(batch, tokens, prefill)
        recorder.step(decided, tokens, [i for i, s in zip(ids, batch, strict=True) if s.status.name == "FINISHED"])
        step += 1
    return out.getvalue()


def workload_trace(workload: Workload) -> Trace:
    return read_trace(record_workload(workload).encode().splitlines(keepends=True))
