"""Conformance workloads, the reader of their JSON-lines files, and the normative replay loop.

A workload is validated whole before any scheduler exists, so a malformed one
changes nothing and is reported by field; ``read_workloads`` validates a whole
file before any of it is replayed, and treats it as hostile bytes: bounded
size, strict UTF-8, bounded nesting, every integer an int64 (spec/cli.md,
CLI-7). Whatever the bytes, the reader returns workloads that replay without
error or raises ``WorkloadError`` naming the line. ``replay`` is the one
workload loop (CONF-2): it drives any implementation through the scheduler
port (``implementation(name)`` gives its factory) and returns the trace
records; a ``ReplayWatcher`` sees each arrival and step (the trace records a
workload through it, TRACE-8). The port's ``EmptyDecodeError`` ends the trace
exactly where the lesson's ``assert scheduled_seqs`` fires.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from optimized.core.config import MINIMUMS, POLICIES, SchedulerConfig
from optimized.core.errors import WorkloadError, is_strict_int
from optimized.core.policies import make_scheduler
from optimized.core.port import EmptyDecodeError, PortFactory, ScheduleOutput, SchedulerPort
from optimized.verify.reference_port import ReferencePort

CONFIG_FIELDS = ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "eos")
# A replay builds every block: bound what one line of input can make this process allocate.
MAXIMUMS = {"num_blocks": 1 << 20, "block_size": 1 << 16}
# Every integer of a workload is an int64 (token ids are hashed and stored as int64).
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# What one input may hold (CLI-7).
MAX_LINE_BYTES = 1 << 20
MAX_INPUT_BYTES = 1 << 26
MAX_DEPTH = 16


@dataclass(frozen=True)
class Request:
    """A request as a workload (CONF-1) and a trace's ``add`` record (TRACE-2) state it, arriving before step
    ``arrive``. ``output`` is a workload's model answers; a trace's request has none (its step records hold the
    tokens), and its ``max_tokens`` is as asked (a later ``cut`` may lower it). ``priority``: the ``priority``
    policy's (spec/policies.md); 0 under every other policy."""

    id: int
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    arrive: int
    output: list[int] = field(default_factory=list)
    priority: int = 0


@dataclass(frozen=True)
class Workload:
    config: dict[str, Any]
    requests: list[Request]


def _shown(value: Any) -> str:
    """``repr(value)``, cut short: an error message stays one short line whatever the input held."""
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


def _int(value: Any, where: str, minimum: int | None = None) -> int:
    if not is_strict_int(value):
        raise WorkloadError(f"{where} must be an integer, got {_shown(value)}")
    if minimum is not None and value < minimum:
        raise WorkloadError(f"{where} must be >= {minimum}, got {_shown(value)}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise WorkloadError(f"{where} must fit in int64 (below 2**63 in magnitude), got {_shown(value)}")
    return value


def _key(obj: dict[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise WorkloadError(f"missing key {where + '.' if where else ''}{key}")
    return obj[key]


def _token_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, list):
        raise WorkloadError(f"{where} must be a list of token ids")
    return [_int(t, f"{where}[{i}]", 0) for i, t in enumerate(value)]


def parse_workload(obj: Any) -> Workload:
    """Validate a workload object; raises WorkloadError naming the first bad field."""
    if not isinstance(obj, dict):
        raise WorkloadError("workload must be an object")
    cfg = _key(obj, "config", "workload")
    if not isinstance(cfg, dict):
        raise WorkloadError("workload.config must be an object")
    config: dict[str, Any] = {f: _int(_key(cfg, f, "config"), f"config.{f}", MINIMUMS[f]) for f in CONFIG_FIELDS}
    for f, most in MAXIMUMS.items():
        if config[f] > most:
            raise WorkloadError(f"config.{f} must be <= {most}, got {config[f]}")
    config.update(_policy_fields(cfg))
    raw = _key(obj, "requests", "workload")
    if not isinstance(raw, list):
        raise WorkloadError("workload.requests must be a list")
    requests: list[Request] = []
    seen: set[int] = set()
    for i, r in enumerate(raw):
        where = f"requests[{i}]"
        if not isinstance(r, dict):
            raise WorkloadError(f"{where} must be an object")
        rid = _int(_key(r, "id", where), f"{where}.id", 0)
        if rid in seen:
            raise WorkloadError(f"{where}.id {rid} is not unique")
        seen.add(rid)
        prompt = _token_list(_key(r, "prompt", where), f"{where}.prompt")
        if not prompt:
            raise WorkloadError(f"{where}.prompt must not be empty")
        max_tokens = _int(_key(r, "max_tokens", where), f"{where}.max_tokens", 1)
        ignore_eos = _key(r, "ignore_eos", where)
        if not isinstance(ignore_eos, bool):
            raise WorkloadError(f"{where}.ignore_eos must be true or false")
        arrive = _int(_key(r, "arrive", where), f"{where}.arrive", 0)
        output = _token_list(_key(r, "output", where), f"{where}.output")
        if len(output) < max_tokens:
            raise WorkloadError(f"{where}.output has {len(output)} tokens, shorter than max_tokens {max_tokens}")
        priority = _int(r.get("priority", 0), f"{where}.priority")
        if priority and config.get("policy") != "priority":
            raise WorkloadError(f"{where}.priority must be 0 unless config.policy is priority, got {priority}")
        requests.append(Request(rid, prompt, max_tokens, ignore_eos, arrive, output, priority))
    return Workload(config, requests)


def _policy_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The optional ``policy`` (one of POLICIES; the lesson's when absent) and ``patience`` (an int >= 0, lpm's
    bound) of a workload's config, as given: a workload without them is the lesson's, its config unchanged."""
    fields: dict[str, Any] = {}
    if "policy" in cfg:
        policy = cfg["policy"]
        if not isinstance(policy, str) or policy not in POLICIES:
            raise WorkloadError(f"config.policy must be one of {', '.join(POLICIES)}, got {_shown(policy)}")
        fields["policy"] = policy
    if "patience" in cfg:
        fields["patience"] = _int(cfg["patience"], "config.patience", 0)
    return fields


IMPLEMENTATIONS: dict[str, PortFactory] = {"reference": ReferencePort, "optimized": make_scheduler}


def implementation(name: str) -> PortFactory:
    """The factory of the scheduler a replay drives through the port: 'reference' or 'optimized', each of the
    config's policy."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be 'reference' or 'optimized', got {name!r}")
    return IMPLEMENTATIONS[name]


StepHook = Callable[[SchedulerPort[Any], list[Any], bool], None]


class ReplayWatcher:
    """What the replay loop tells whoever watches it, in the order it happens; each hook does nothing here."""

    def added(self, step: int, request: Request) -> None:
        """``request`` was added before step ``step``'s schedule()."""

    def scheduled(self, port: SchedulerPort[Any], out: ScheduleOutput[Any]) -> None:
        """Step's schedule() decided ``out``."""

    def stepped(self, port: SchedulerPort[Any], record: dict[str, Any], tokens: list[int]) -> None:
        """The step's postprocess ran on ``tokens``; ``record`` is its trace record (CONF-3). The empty decode's
        record (CONF-4) comes here too, with no tokens: it ends the replay."""


class _Hooks(ReplayWatcher):
    """``replay``'s two function hooks as a watcher: (port, batch, is_prefill) after schedule() and postprocess()."""

    def __init__(self, on_schedule: StepHook | None, on_postprocess: StepHook | None) -> None:
        self.on_schedule, self.on_postprocess = on_schedule, on_postprocess
        self.batch: list[Any] = []
        self.is_prefill = False

    def scheduled(self, port: SchedulerPort[Any], out: ScheduleOutput[Any]) -> None:
        self.batch, self.is_prefill = out.batch, out.is_prefill
        if self.on_schedule is not None:
            self.on_schedule(port, out.batch, out.is_prefill)

    def stepped(self, port: SchedulerPort[Any], record: dict[str, Any], tokens: list[int]) -> None:
        if self.on_postprocess is not None and "error" not in record:
            self.on_postprocess(port, self.batch, self.is_prefill)


def replay(workload: Workload, factory: PortFactory, on_schedule: StepHook | None = None,
           on_postprocess: StepHook | None = None, watcher: ReplayWatcher | None = None) -> list[dict[str, Any]]:
    """Run the normative replay loop (CONF-2) and return its trace records (CONF-3, CONF-4).

    ``on_schedule`` sees (port, batch, is_prefill) right after schedule(); ``on_postprocess`` the same right
    after postprocess(). Tests hang invariant checks there. ``watcher`` sees every arrival and step.
    """
    port = factory(SchedulerConfig(**workload.config))
    watchers = [w for w in (_Hooks(on_schedule, on_postprocess), watcher) if w is not None]
    pending = sorted(workload.requests, key=lambda r: (r.arrive, r.id))
    request_of: dict[int, Request] = {}
    trace: list[dict[str, Any]] = []
    step = 0
    while pending or not port.is_finished():
        while pending and pending[0].arrive <= step:
            r = pending.pop(0)
            seq = port.new_sequence(r.prompt, r.max_tokens, r.ignore_eos)
            request_of[seq.seq_id] = r
            for w in watchers:
                w.added(step, r)
            port.add(seq, priority=r.priority)
        if port.is_finished():
            step = pending[0].arrive
            continue
        try:
            out = port.schedule()
        except EmptyDecodeError:
            trace.append({"step": step, "error": "empty decode"})
            for w in watchers:
                w.stepped(port, trace[-1], [])
            break
        seqs, is_prefill = out.batch, out.is_prefill
        for w in watchers:
            w.scheduled(port, out)
        record: dict[str, Any] = {
            "step": step,
            "prefill": is_prefill,
            "batch": [[request_of[s.seq_id].id, s.num_scheduled_tokens, list(s.block_table)] for s in seqs],
            "preempted": sorted(request_of[s.seq_id].id for s in out.preempted),
        }
        tokens = [request_of[s.seq_id].output[s.num_completion_tokens] for s in seqs]
        finished = port.postprocess(seqs, tokens, is_prefill)
        record["finished"] = [request_of[s.seq_id].id for s in finished]
        trace.append(record)
        for w in watchers:
            w.stepped(port, record, tokens)
        step += 1
    return trace


# One left-to-right pass finds the brackets outside strings: a string (escapes included; an unterminated
# one runs to the end of the line, so nothing is scanned twice) or a bracket.
_STRING_OR_BRACKET = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.DOTALL)
_NESTING = {"[": 1, "{": 1, "]": -1, "}": -1}


def _too_deep(text: str) -> bool:
    """Whether the arrays and objects of ``text`` nest deeper than MAX_DEPTH (brackets in strings do not count)."""
    depth = 0
    for m in _STRING_OR_BRACKET.finditer(text):
        depth += _NESTING.get(m.group(), 0)
        if depth > MAX_DEPTH:
            return True
    return False


def bounded_lines(stream: BinaryIO, max_total: int, error: type[ValueError] = WorkloadError, what: str = "input",
                  first: list[bytes] | None = None) -> list[bytes]:
    """``first``, then the stream's lines; ``error`` for a line over MAX_LINE_BYTES or a total over ``max_total``
    bytes (``what`` names the whole), without reading on."""
    lines = list(first or [])
    total = sum(map(len, lines))
    while line := stream.readline(MAX_LINE_BYTES + 1):
        total += len(line)
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            raise error(f"line {len(lines) + 1}: longer than {MAX_LINE_BYTES} bytes")
        if total > max_total:
            raise error(f"{what} longer than {max_total} bytes")
        lines.append(line)
    return lines


def _json_line(raw: bytes) -> Any:
    """One line as JSON: strict UTF-8, nested at most MAX_DEPTH deep; WorkloadError otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise WorkloadError(f"not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    if _too_deep(text):
        raise WorkloadError(f"nested deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        message = e.msg.removesuffix(" at")  # "Invalid control character at": the column follows
        raise WorkloadError(f"not JSON ({message} at column {e.colno})") from None
    except ValueError as e:  # e.g. an integer of more digits than int() converts
        raise WorkloadError(f"not JSON ({_shown(str(e))})") from None


def read_workloads(stream: BinaryIO) -> list[Workload]:
    """Every workload of a JSON-lines byte stream, all validated before any is replayed (CONF-6, CLI-7).

    Blank lines and lines without a ``workload`` key are skipped; anything else wrong raises WorkloadError
    naming the line.
    """
    workloads: list[Workload] = []
    for number, raw in enumerate(bounded_lines(stream, MAX_INPUT_BYTES), start=1):
        if not raw.strip():
            continue
        try:
            obj = _json_line(raw)
            if isinstance(obj, dict) and "workload" in obj:
                workloads.append(parse_workload(obj["workload"]))
        except WorkloadError as e:
            raise WorkloadError(f"line {number}: {e}") from None
    return workloads
