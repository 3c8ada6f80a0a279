"""The recorder: writes a run as it happens, one JSON line per event, flushed once per step (TRACE-1..4).

Invariant: after each ``step``, ``failed`` or ``empty_decode`` call returns,
every event so far is on disk, in the order it happened, so a crash loses at
most the step in flight (and the adds and aborts since the last step). The
recorder knows nothing of the engine: a caller hands it request ids, the
schedule's decisions and the model's tokens; ``record_engine_step`` and
``record_engine_failure`` adapt the engine's own objects (a server records
through the ``LLM`` calls it makes, like any caller). Arrivals are stamped with
the number of the next step, so a request added while the engine idles arrives
before the step that follows. No line is written that the reader would refuse
(over 1 MiB), and once closed or broken the recorder refuses every write.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

from optimized.core.config import DEFAULT_PATIENCE
from optimized.trace.schema import VERSION
from optimized.verify.conformance import MAX_LINE_BYTES
from optimized.verify.shadow import SchedulerKnobs

Entry = tuple[int, int, Sequence[int]]  # request id, tokens scheduled, block table
INT64_MAX = (1 << 63) - 1  # the widest request id or step number an add record can hold
INT64_MIN = -(1 << 63)  # the widest priority one can hold


def header(config: SchedulerKnobs, eos_token_ids: Iterable[int] = (), **extra: Any) -> dict[str, Any]:
    """The first record: the format's version and the configuration the run used (TRACE-1), its policy and
    patience named unless it is the lesson's."""
    cfg: dict[str, Any] = {
        "block_size": config.block_size,
        "num_blocks": config.num_blocks,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "eos": config.eos,
        "eos_token_ids": [int(t) for t in eos_token_ids],
        **extra,
    }
    policy = getattr(config, "policy", "lesson")
    if policy != "lesson":  # a lesson's header is as it always was: without them, a trace is the lesson's
        cfg.update(policy=policy, patience=getattr(config, "patience", DEFAULT_PATIENCE))
    return {"version": VERSION, "config": cfg}


def add_record(request_id: int, prompt: Sequence[int], max_tokens: int, ignore_eos: bool, arrive: int,
               priority: int = 0) -> str:
    """A request's ``add`` line (its priority written where it is not 0); ValueError when the trace reader would
    refuse it (over 1 MiB)."""
    record: dict[str, Any] = {"id": request_id, "prompt": [int(t) for t in prompt], "max_tokens": max_tokens,
                              "ignore_eos": ignore_eos, "arrive": arrive}
    if priority:
        record["priority"] = int(priority)
    line = json.dumps({"add": record}) + "\n"
    if len(line) > MAX_LINE_BYTES:
        raise ValueError(f"the trace's add record for this prompt would be {len(line)} bytes, past the trace "
                         f"reader's {MAX_LINE_BYTES}-byte line limit: the request is refused")
    return line


def check_add_record(prompt: Sequence[int], max_tokens: int, ignore_eos: bool) -> None:
    """ValueError when the request's ``add`` record, whatever its id, step and priority (POLICY-12), would be a line
    the reader refuses: the request is refused with the other limits (ENG-10, TRACE-4), before anything changes."""
    add_record(INT64_MAX, prompt, max_tokens, ignore_eos, INT64_MAX, INT64_MIN)


class Recorder:
    """Appends a run's records to ``out`` (a path, opened for writing, or an open text stream)."""

    def __init__(self, out: str | Path | TextIO, config: SchedulerKnobs, eos_token_ids: Iterable[int] = (),
                 wall_times: bool = False, **extra: Any) -> None:
        if isinstance(out, (str, Path)):
            self.file: TextIO = open(out, "w", encoding="utf-8")  # noqa: SIM115 (closed by close() or finalize)
            self._closer = weakref.finalize(self, self.file.close)
        else:
            self.file = out
        self.wall_times = wall_times
        self.name = str(out) if isinstance(out, (str, Path)) else "the trace stream"
        self.broken: str | None = None  # why an earlier write failed: the file is no longer the whole run
        self.closed = False  # close() was called: nothing more is recorded
        self.steps = 0  # schedule() calls recorded: the number the next step gets
        self._tables: dict[int, list[int]] = {}  # request id -> a copy of its last recorded block table
        self._batch: list[int] = []  # the request ids of the step last decided
        self._origin = time.perf_counter()
        self._write(json.dumps(header(config, eos_token_ids, **extra)) + "\n")

    def require_writable(self) -> None:
        """Raise unless a record can still be written: refused before a change begins, so nothing is half done."""
        if self.closed:
            raise RuntimeError(f"the trace {self.name} was closed (LLM.close()): this LLM records nothing more, "
                               "make a new LLM")
        if self.broken is not None:
            raise OSError(f"the trace is incomplete since an earlier write failed ({self.broken})")

    def _write(self, text: str, flush: bool = True) -> None:
        """Append ``text`` (flushed unless told not to); after a failed write, every later one raises (TRACE-4)."""
        self.require_writable()
        try:
            self.file.write(text)
            if flush:
                self.file.flush()
        except OSError as error:
            if error.filename is None:
                error.filename = self.name  # a failed write names no file; the user needs to know which
            self.broken = _describe(error)
            self._abandon_file()
            raise

    def _abandon_file(self) -> None:
        """Close a file this recorder opened after a write failed, dropping what its buffer still holds: the trace
        is incomplete whatever follows, and a later flush (by ``close()`` or at exit) would only fail again."""
        closer = getattr(self, "_closer", None)
        if closer is None:
            return
        closer.detach()
        with contextlib.suppress(OSError):  # the buffer's flush fails as the write did; the descriptor is closed
            self.file.close()

    # --- between steps ----------------------------------------------------------------------------------
    def at_step(self, number: int) -> None:
        """The next step record is numbered ``number`` (a workload's loop jumps there while idle, TRACE-8)."""
        if number < self.steps:
            raise ValueError(f"step {number} is before step {self.steps}, the next one: step numbers increase")
        self.steps = number

    def add(self, request_id: int, prompt: Sequence[int], max_tokens: int, ignore_eos: bool,
            priority: int = 0) -> None:
        """A request arrived (it is scheduled from the next step on); written with that step."""
        self.write_add(self.add_line(request_id, prompt, max_tokens, ignore_eos, priority))

    def check_add(self, prompt: Sequence[int], max_tokens: int, ignore_eos: bool) -> None:
        """ValueError when the trace can take no more, or as ``check_add_record``."""
        self.require_writable()
        check_add_record(prompt, max_tokens, ignore_eos)

    def add_line(self, request_id: int, prompt: Sequence[int], max_tokens: int, ignore_eos: bool,
                 priority: int = 0) -> str:
        """The ``add`` record's line, made before the request is added anywhere (ValueError as ``check_add``)."""
        self.require_writable()
        return add_record(request_id, prompt, max_tokens, ignore_eos, self.steps, priority)

    def write_add(self, line: str) -> None:
        """Write an ``add_line`` (with the next step's flush)."""
        self._write(line, flush=False)

    def abort(self, request_id: int) -> None:
        self._forget([request_id])
        self._write(f'{{"abort": {request_id}, "before": {self.steps}}}\n', flush=False)

    # --- steps ------------------------------------------------------------------------------------------
    def decided(self, prefill: bool, batch: Sequence[Entry], preempted: Iterable[int]) -> str:
        """What ``schedule()`` decided, serialized now (block tables change when the step finishes sequences);
        hand it to ``step`` or ``failed`` once the step has run."""
        change = self._table_change
        entries = ",".join([f"[{i},{n},{change(i, t)}]" for i, n, t in batch])
        self._batch = [i for i, _, _ in batch]
        return (f'{{"step":{self.steps},"prefill":{"true" if prefill else "false"},"batch":[{entries}],'
                f'"preempted":{json.dumps(sorted(preempted))}')

    def _table_change(self, request_id: int, table: Sequence[int]) -> str:
        """``k,[added]``: the table is the request's last recorded one's first ``k`` blocks, then ``added`` (TRACE-2).
        A decode step mostly repeats or extends last step's table: compared with the kept copy (C-speed, never
        trusting that tables only grow), so a step's line grows with the blocks added, not with the tables."""
        last = self._tables.get(request_id, [])
        kept = len(last)
        if len(table) < kept or table[:kept] != last:
            kept = next((k for k, (a, b) in enumerate(zip(last, table, strict=False)) if a != b),
                        min(len(last), len(table)))
        if kept == len(last) == len(table):
            return f"{kept},[]"
        self._tables[request_id] = list(table)
        return f"{kept},{json.dumps(list(table[kept:]), separators=(',', ':'))}"

    def step(self, decided: str, tokens: Sequence[int], finished: Sequence[int],
             cuts: Sequence[tuple[int, int]] = (), start: float | None = None) -> None:
        """A step that ran: the model's token per batch entry, who finished, the stop cuts (TRACE-2, TRACE-3)."""
        head = "".join(f'{{"cut": {rid}, "max_tokens": {n}}}\n' for rid, n in cuts)
        self._forget(finished)
        self._end_step(head, f'{decided},"tokens":{json.dumps(list(tokens))},"finished":{json.dumps(list(finished))}',
                       start)

    def failed(self, decided: str, reason: str, start: float | None = None) -> None:
        """A step whose model run raised: its batch was aborted (FAULT-2), nothing it computed kept."""
        self._forget(self._batch)  # FAULT-2 aborted the batch: the reader forgets these tables too
        self._end_step("", f'{decided},"failed":{json.dumps(reason)}', start)

    def _forget(self, request_ids: Iterable[int]) -> None:
        for rid in request_ids:
            self._tables.pop(rid, None)

    def empty_decode(self) -> None:
        self._end_step("", f'{{"step":{self.steps},"error":"empty decode"', None)

    def _end_step(self, head: str, body: str, start: float | None) -> None:
        if self.wall_times:
            end = time.perf_counter() - self._origin
            begin = end if start is None else start - self._origin
            body += f',"wall":[{begin:.6f},{end:.6f}]'
        if len(body) + 2 > MAX_LINE_BYTES:  # the reader would refuse the line: a write that failed (TRACE-4)
            self.broken = f"step {self.steps}'s record would be {len(body) + 2} bytes, past {MAX_LINE_BYTES}"
            raise ValueError(f"the trace cannot record step {self.steps}: its line would be {len(body) + 2} bytes, "
                             f"past the trace reader's {MAX_LINE_BYTES}-byte line limit")
        self._write(f"{head}{body}}}\n")
        self.steps += 1

    def close(self) -> None:
        """Flush, and close a file this recorder opened, even when the flush raises; again is a no-op."""
        if self.closed:
            return
        self.closed = True
        try:
            if not self.file.closed:
                self.file.flush()
        finally:
            closer = getattr(self, "_closer", None)
            if closer is not None:
                closer()


# --- the engine's side ---------------------------------------------------------------------------------------
class Tracked(Protocol):
    """What the recorder reads of an engine request."""

    arrival: int
    seq: Any
    params: Any


def _entries(out: Any, requests: Sequence[Tracked]) -> list[Entry]:
    return [(r.arrival, s.num_scheduled_tokens, s.block_table) for r, s in zip(requests, out.batch, strict=True)]


def record_schedule(recorder: Recorder, out: Any, requests: Sequence[Tracked], live: Mapping[int, Tracked]) -> str:
    """The engine's ``schedule()`` output ``out`` (its batch's requests: ``requests``), serialized at once."""
    return recorder.decided(out.is_prefill, _entries(out, requests), [live[s.seq_id].arrival for s in out.preempted])


def stop_cut(request: Tracked, eos: int) -> int | None:
    """The lowered ``max_tokens`` when a stop token (not EOS, not the length) finished ``request``; else None."""
    seq = request.seq
    produced = seq.num_completion_tokens
    by_eos = not request.params.ignore_eos and seq.last_token == eos
    return produced if produced < request.params.max_tokens and not by_eos else None


def record_engine_step(recorder: Recorder, decided: str, tokens: Any, finished: Sequence[Tracked], eos: int,
                       start: float) -> None:
    """The engine's step that ran, after postprocess: ``finished`` the requests it finished."""
    cuts = [(r.arrival, n) for r in finished if (n := stop_cut(r, eos)) is not None]
    listed = tokens.tolist() if hasattr(tokens, "tolist") else tokens
    recorder.step(decided, listed, [r.arrival for r in finished], cuts, start)


def record_engine_failure(recorder: Recorder, decided: str, fault: BaseException, start: float) -> None:
    """The engine's step whose model run raised ``fault``.

    Never raises (FAULT-5: ``fault`` is what propagates): a failure to write is noted on ``fault``, and the
    recorder refuses every later write, so the next step raises instead of leaving a gap in the file (TRACE-4).
    """
    try:
        recorder.failed(decided, _describe(fault), start)
    except Exception as error:
        recorder.broken = recorder.broken or _describe(error)
        fault.add_note(f"recording the failed step in the trace then raised {_describe(error)}")


class TraceObserver:
    """The recorder as the engine's ``StepObserver`` (ARCH-3): each change of the engine written as it happens."""

    def __init__(self, recorder: Recorder, eos: int) -> None:
        self.recorder = recorder
        self.eos = eos  # the scheduler's own EOS: a stop by it is no cut (TRACE-3)
        self._decided = ""  # the step in progress's decisions, serialized when made

    def before_change(self) -> None:
        self.recorder.require_writable()

    def check_add(self, token_ids: Sequence[int], params: Any) -> None:
        self.recorder.check_add(token_ids, params.max_tokens, params.ignore_eos)

    def added(self, request: Any) -> None:
        seq, params = request.seq, request.params
        self.recorder.add(request.arrival, seq.token_ids[: seq.num_prompt_tokens], params.max_tokens,
                          params.ignore_eos, request.priority)

    def scheduled(self, scheduler: Any, out: Any, requests: Sequence[Tracked], live: Mapping[int, Tracked]) -> None:
        self._decided = record_schedule(self.recorder, out, requests, live)

    def stepped(self, scheduler: Any, tokens: Any, finished: Sequence[Tracked], start: float) -> None:
        record_engine_step(self.recorder, self._decided, tokens, finished, self.eos, start)

    def step_failed(self, fault: BaseException, start: float) -> None:
        record_engine_failure(self.recorder, self._decided, fault, start)

    def batch_withdrawn(self, scheduler: Any, failed: Sequence[Any], live: Mapping[int, Any]) -> None:
        """Recorded by ``step_failed`` already: the failed record names the batch (TRACE-2)."""

    def aborted(self, scheduler: Any, request: Tracked, live: Mapping[int, Any]) -> None:
        self.recorder.abort(request.arrival)

    def close(self) -> None:
        self.recorder.close()


def _describe(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def trace_file(path: str | Path | None) -> Path | None:
    """``LLM(trace=...)``'s file, if one can be written there, checked before anything loads (EngineArgs has
    checked the value itself: a non-empty path or None)."""
    return None if path is None else _writable(Path(path))


def _writable(path: Path) -> Path:
    """``path`` if a trace can be written there (a file to create in an existing, writable folder, or a writable
    file to empty); else a ValueError naming it, before the model loads."""
    folder = path.parent
    if path.is_dir():
        raise ValueError(f"trace {str(path)!r} is a folder, not a file")
    if not folder.is_dir():
        raise ValueError(f"trace {str(path)!r}: its folder {str(folder)!r} does not exist")
    if not os.access(path if path.exists() else folder, os.W_OK):
        raise ValueError(f"trace {str(path)!r} cannot be written (no write permission)")
    existed = path.exists()
    try:  # what the filesystem allows only an open tells (procfs, a read-only mount): asked before anything loads
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as error:
        raise ValueError(f"trace {str(path)!r} cannot be written ({error.strerror or error})") from None
    if not existed:
        path.unlink(missing_ok=True)  # only a probe: the file is made when the run starts
    return path
