"""Replay a recorded trace through a scheduler and compare every decision (TRACE-5, TRACE-6).

Invariant: the replay drives the scheduler exactly as the recorded run drove
its own: adds, aborts and steps in file order; each step's recorded tokens are
handed to ``postprocess`` (a failed step's batch is withdrawn with
``abort_step`` instead, FAULT-2); a request cut by a stop token is added with
its ``max_tokens`` lowered to what it produced, which finishes it in the same
postprocess, in the same batch position (TRACE-3). Either scheduler is driven
through the scheduler port (ARCH-4), which reports whom a step preempted and
whom a postprocess finished, so the replay never asks which one it holds.
After every ``schedule()`` the batch, prefill flag and preemptions are compared
with the record and the invariants of ``optimized.trace.checks`` checked (every
batch invariant, INV-2 on the held blocks; the whole state every
``FULL_EVERY``-th step and at the end); after every postprocess the finished
ids are compared and the held blocks checked again. The first difference ends
the replay and is named by step and field.
"""

from __future__ import annotations

import contextlib
import os
import resource
from dataclasses import dataclass
from typing import Any, Protocol

from optimized.core.config import SchedulerConfig
from optimized.core.port import EmptyDecodeError, PortFactory, SchedulerPort
from optimized.trace.checks import FULL_EVERY, batch_violations, state_violations
from optimized.trace.schema import Aborted, Step, Trace, TraceError
from optimized.verify.conformance import Request, implementation

# What a replay holds per block at its peak, with margin: measured (tracemalloc) about 650 bytes a block for the
# reference and 530 for the optimized scheduler during a full state check (TRACE-13).
REPLAY_BYTES_PER_BLOCK = 1024


def available_memory() -> int | None:
    """Bytes this process may still allocate, as far as the system says: the kernel's MemAvailable, or less under an
    address-space or data limit (ulimit -v, -d); None where neither can be read."""
    known: list[int] = []
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    known.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY:
            known.append(soft)
    if not known and hasattr(os, "sysconf"):
        with contextlib.suppress(OSError, ValueError):
            known.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return min(known) if known else None


def require_memory(num_blocks: int) -> None:
    """TRACE-13: a TraceError naming ``config.num_blocks`` when replaying that many blocks needs more memory than
    the machine has available, before any block is built (the header's bound alone, 2**31, is 2 TiB)."""
    need, have = num_blocks * REPLAY_BYTES_PER_BLOCK, available_memory()
    if have is not None and need > have:
        raise TraceError(f"config.num_blocks: {num_blocks} blocks need about {_gib(need)} of memory to replay "
                         f"({REPLAY_BYTES_PER_BLOCK} bytes a block), more than the {_gib(have)} available here")


def _gib(size: int) -> str:
    return f"{size / (1 << 30):.1f} GiB"


class Observer(Protocol):
    """Watches a replay: ``scheduled`` right after each ``schedule()`` returned a batch, ``stepped`` after each
    step replayed identically (with the record, the scheduler, its batch and the request id of each seq_id)."""

    def scheduled(self, scheduler: SchedulerPort[Any]) -> None: ...

    def stepped(self, record: Step, scheduler: SchedulerPort[Any], batch: list[Any], id_of: dict[int, int]) -> None: ...


@dataclass(frozen=True)
class Outcome:
    steps: int  # step records in the trace
    identical: int  # steps replayed identically, before the first difference
    difference: str | None = None  # the first difference, named by step and field

    @property
    def ok(self) -> bool:
        return self.difference is None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:120] + "..."


def first_difference(field: str, recorded: Any, replayed: Any) -> str | None:
    """``None`` when equal; else the field (and, in a list, the first differing index) and both values."""
    if recorded == replayed:
        return None
    if isinstance(recorded, list) and isinstance(replayed, list):
        for i, (a, b) in enumerate(zip(recorded, replayed, strict=False)):
            if a != b:
                return f"{field}[{i}]: recorded {_shown(a)}, replayed {_shown(b)}"
        return f"{field}: recorded {len(recorded)} entries, replayed {len(replayed)}"
    return f"{field}: recorded {_shown(recorded)}, replayed {_shown(replayed)}"


class _Driver:
    def __init__(self, trace: Trace, factory: PortFactory, observer: Observer | None) -> None:
        self.trace = trace
        self.observer = observer
        require_memory(trace.config["num_blocks"])
        self.scheduler = factory(SchedulerConfig(**trace.config))
        self.replayed = 0  # step records replayed so far
        self.full = False  # whether the current step checks the whole state
        self.seq_of: dict[int, Any] = {}  # request id -> sequence
        self.id_of: dict[int, int] = {}  # seq_id -> request id

    def add(self, added: Request) -> None:
        seq = self.scheduler.new_sequence(added.prompt, self.trace.max_tokens(added), added.ignore_eos)
        self.seq_of[added.id] = seq
        self.id_of[seq.seq_id] = added.id
        self.scheduler.add(seq, priority=added.priority)

    def abort(self, aborted: Aborted) -> str | None:
        try:
            self.scheduler.abort(self.seq_of[aborted.id])
        except ValueError:
            return f"before step {aborted.before}: abort of request {aborted.id}, which the replay has finished"
        return self._violations(f"after the abort of request {aborted.id}")

    def step(self, record: Step) -> tuple[str | None, list[Any]]:
        """The first difference of this step (None: identical) and the replayed batch."""
        sched, n = self.scheduler, record.step
        self.full = self.replayed % FULL_EVERY == FULL_EVERY - 1  # every FULL_EVERY-th step checks the whole state too
        self.replayed += 1
        try:
            out = sched.schedule()
        except EmptyDecodeError:
            return (None if record.empty_decode else f"step {n}: the replay hit the empty decode (EDGE-2), "
                    "the trace records a batch"), []
        batch, prefill = out.batch, out.is_prefill
        if record.empty_decode:
            return f"step {n}: the trace records the empty decode, the replay scheduled a batch", batch
        if self.observer is not None:
            self.observer.scheduled(sched)
        ids = self.id_of
        replayed = [(ids[s.seq_id], s.num_scheduled_tokens, list(s.block_table)) for s in batch]
        preempted = sorted(ids[s.seq_id] for s in out.preempted)
        difference = (first_difference("prefill", record.prefill, prefill)
                      or first_difference("batch", [list(e) for e in record.batch], [list(e) for e in replayed])
                      or first_difference("preempted", record.preempted, preempted)
                      or self._batch_violations(batch, prefill))
        if difference is None:
            difference = self._finish_step(record, batch, prefill)
        return (None if difference is None else f"step {n}: {difference}"), batch

    def _finish_step(self, record: Step, batch: list[Any], prefill: bool) -> str | None:
        sched = self.scheduler
        if record.failed is not None:
            sched.abort_step(batch)
            return self._violations("after the failed step")
        finished = [self.id_of[s.seq_id] for s in sched.postprocess(batch, record.tokens, prefill)]
        return first_difference("finished", record.finished, finished) or self._violations(
            "after postprocess")

    def _batch_violations(self, batch: list[Any], prefill: bool) -> str | None:
        found = batch_violations(self.scheduler, batch, prefill, self.full, self._priorities())
        return f"invariant {found[0].clause} after schedule(): {found[0].message}" if found else None

    def _priorities(self) -> dict[int, int] | None:
        """Under ``priority``: each live sequence's priority as the trace recorded it, by seq_id, for POLICY-6."""
        if self.trace.policy != "priority":
            return None
        sched, trace, ids = self.scheduler, self.trace, self.id_of
        return {s.seq_id: trace.priority(ids[s.seq_id]) for s in (*sched.running, *sched.waiting)}

    def _violations(self, when: str, full: bool = False) -> str | None:
        found = state_violations(self.scheduler, full or self.full, self._priorities())
        return f"invariant {found[0].clause} {when}: {found[0].message}" if found else None

    def end(self) -> str | None:
        """The whole state checked once more after the last record."""
        found = state_violations(self.scheduler, True, self._priorities())
        return f"after the last step: invariant {found[0].clause}: {found[0].message}" if found else None


def replay_trace(trace: Trace, impl_name: str, observe: Observer | None = None) -> Outcome:
    """Replay ``trace`` through 'reference' or 'optimized'; how many steps were identical, and the first difference."""
    driver = _Driver(trace, implementation(impl_name), observe)
    total, identical = len(trace.steps), 0
    for event in trace.events:
        if isinstance(event, Request):
            driver.add(event)
            continue
        if isinstance(event, Aborted):
            difference = driver.abort(event)
        else:
            difference, batch = driver.step(event)
            if difference is None:
                identical += 1
                if observe is not None:
                    observe.stepped(event, driver.scheduler, batch, driver.id_of)
        if difference is not None:
            return Outcome(total, identical, difference)
    return Outcome(total, identical, driver.end())
