"""The trace format (spec/trace.md, TRACE-1..6) and its reader.

Invariant: ``read_trace`` returns a ``Trace`` whose events replay in file order
without a malformed field anywhere: every record is validated (by line and
field) before anything is replayed, so a bad file changes nothing and never
half-replays. A last line cut short (the recording process died mid-write) is
not an error: it is reported in ``Trace.truncated`` and every line before it
replays. A trace is JSON lines: a header ``{"version": 2, "config": {...}}``,
then, in the order they happened, ``add`` records (a request arrived before
step ``arrive``), ``abort`` records, ``cut`` records (a stop token ended a
request early: its ``max_tokens`` lowered to what it produced) and the
conformance step records of CONF-3, extended with the model's ``tokens`` or a
``failed`` reason; in version 2 a batch entry's block table is written as the
change from the request's last recorded one (``Tables``). The header's config
names the scheduling policy and lpm's patience (a trace without them is the
lesson's, patience 8: every older trace still reads), an ``add`` record its
request's priority (absent: 0; only the ``priority`` policy has others).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from optimized.core.config import DEFAULT_PATIENCE, MINIMUMS, POLICIES
from optimized.verify.conformance import CONFIG_FIELDS, Request, bounded_lines
from optimized.verify.conformance import _json_line as json_line

VERSION = 2  # what the recorder writes: block tables as deltas (TRACE-2); version 1 (whole tables) still reads
VERSIONS = (1, 2)
# A trace is a whole run: allowed longer than a workload file (CLI-7's 64 MiB); each line still at most 1 MiB.
MAX_TRACE_BYTES = 1 << 30
INT64_MIN = -(1 << 63)
STEP_KEYS = ("step", "prefill", "batch", "preempted")
# A trace header's bounds: a workload's (CLI-7) would refuse a GPU run, whose cache has millions of blocks. Block
# ids are int32 on the device, so no run has 2**31 blocks; a replay builds every block (memory in proportion).
HEADER_MINIMUMS = {name: INT64_MIN if least is None else least for name, least in MINIMUMS.items()}  # int64 fields
HEADER_MAXIMUMS = {"num_blocks": 1 << 31, "block_size": 1 << 16}


class TraceError(ValueError):
    """A trace file is malformed; the message names the line and the field."""


@dataclass(frozen=True)
class Aborted:
    id: int
    before: int


@dataclass(frozen=True)
class Step:
    """One ``schedule()`` call: what it decided and how the step ended (tokens, a failure, an empty decode)."""

    step: int
    prefill: bool = False
    batch: list[tuple[int, int, list[int]]] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    failed: str | None = None
    empty_decode: bool = False
    wall: tuple[float, float] | None = None


Event = Request | Aborted | Step  # an ``add`` record is a Request without ``output``, the one request record


@dataclass
class Trace:
    config: dict[str, Any]
    events: list[Event]
    eos_token_ids: list[int] = field(default_factory=list)
    cuts: dict[int, int] = field(default_factory=dict)  # request id -> lowered max_tokens
    priorities: dict[int, int] = field(default_factory=dict)  # request id -> its priority, where not 0
    truncated: str | None = None  # why the last line was dropped, when it was cut short

    @property
    def steps(self) -> list[Step]:
        return [e for e in self.events if isinstance(e, Step)]

    @functools.cached_property
    def _step_numbers(self) -> list[int]:
        """The step numbers, increasing (read once the trace is whole)."""
        return [s.step for s in self.steps]

    def max_tokens(self, added: Request) -> int:
        """The ``max_tokens`` a replay gives the request: lowered by its cut, if it has one, and to one past the
        number of steps from its arrival on. A step appends at most one token, so within the trace the count never
        reaches that bound and the decisions are the same; a hostile ``max_tokens`` cannot make the replay reserve
        room for more tokens than the trace can produce (TRACE-4)."""
        numbers = self._step_numbers
        steps_from_arrival = len(numbers) - bisect.bisect_left(numbers, added.arrive)
        return min(self.cuts.get(added.id, added.max_tokens), steps_from_arrival + 1)

    @property
    def policy(self) -> str:
        return str(self.config.get("policy", "lesson"))

    def priority(self, request_id: int) -> int:
        return self.priorities.get(request_id, 0)


def is_trace_header(obj: Any) -> bool:
    return isinstance(obj, dict) and "version" in obj


def _fail(where: str, message: str) -> TraceError:
    return TraceError(f"{where}: {message}")


def _int(value: Any, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < (1 << 63):
        shown = "-2**63" if minimum == INT64_MIN else str(minimum)
        raise _fail(where, f"must be an integer in [{shown}, 2**63), got {value!r}"[:200])
    return value


def _ints(value: Any, where: str, minimum: int = 0) -> list[int]:
    if not isinstance(value, list):
        raise _fail(where, "must be a list of integers")
    return [_int(v, f"{where}[{i}]", minimum) for i, v in enumerate(value)]


def _key(obj: dict[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise _fail(where, f"missing field {key!r}")
    return obj[key]


def parse_header(obj: Any) -> tuple[dict[str, Any], list[int], int]:
    """The header's scheduler config (CONF-1's fields, the header's own bounds, the policy and patience) and EOS
    ids; TraceError naming the field."""
    if not is_trace_header(obj):
        raise _fail("header", "the first record must be the header {\"version\": 2, \"config\": {...}}")
    if isinstance(obj["version"], bool) or obj["version"] not in VERSIONS:
        raise _fail("version", f"must be 1 or 2, got {obj['version']!r}"[:200])
    cfg = _key(obj, "config", "header")
    if not isinstance(cfg, dict):
        raise _fail("config", "must be an object")
    config: dict[str, Any] = {f: _int(_key(cfg, f, "config"), f"config.{f}", HEADER_MINIMUMS[f])
                              for f in CONFIG_FIELDS}
    for name, most in HEADER_MAXIMUMS.items():
        if config[name] > most:
            raise _fail(f"config.{name}", f"must be at most {most}, got {config[name]}")
    policy = cfg.get("policy", "lesson")
    if not isinstance(policy, str) or policy not in POLICIES:
        raise _fail("config.policy", f"must be one of {', '.join(POLICIES)}, got {policy!r}"[:200])
    config["policy"] = policy
    config["patience"] = _int(cfg.get("patience", DEFAULT_PATIENCE), "config.patience")
    eos_ids = _ints(cfg.get("eos_token_ids", []), "config.eos_token_ids")
    return config, eos_ids, obj["version"]


def _added(obj: Any, first: int) -> Request:
    """An ``add`` record: CONF-1's request fields less ``output`` (the step records hold the tokens)."""
    if not isinstance(obj, dict):
        raise _fail("add", "must be an object")
    rid = _int(_key(obj, "id", "add"), "add.id")
    prompt = _ints(_key(obj, "prompt", "add"), "add.prompt")
    if not prompt:
        raise _fail("add.prompt", "must not be empty")
    max_tokens = _int(_key(obj, "max_tokens", "add"), "add.max_tokens", 1)
    ignore_eos = _key(obj, "ignore_eos", "add")
    if not isinstance(ignore_eos, bool):
        raise _fail("add.ignore_eos", "must be true or false")
    arrive = _int(_key(obj, "arrive", "add"), "add.arrive")
    if arrive < first:
        raise _fail("add.arrive", f"is {arrive}, but step {first - 1} precedes this record")
    return Request(rid, prompt, max_tokens, ignore_eos, arrive)


def _priority(obj: dict[str, Any], policy: str) -> int:
    """An ``add`` record's priority: an int64, absent 0, and 0 unless the policy is ``priority`` (POLICY-12)."""
    priority = _int(obj.get("priority", 0), "add.priority", INT64_MIN)
    if priority and policy != "priority":
        raise _fail("add.priority", f"must be 0 unless config.policy is priority (the trace's is {policy}), "
                                    f"got {priority}")
    return priority


class Tables:
    """Each request's block table as last recorded: a version-2 entry ``[id, tokens, k, added]`` is the last
    table's first ``k`` blocks, then ``added``; a version-1 entry ``[id, tokens, table]`` the whole table."""

    def __init__(self, version: int, num_blocks: int) -> None:
        self.delta = version >= 2
        self.num_blocks = num_blocks
        self.last: dict[int, list[int]] = {}

    def entry(self, entry: Any, where: str) -> tuple[int, int, list[int]]:
        shape = "[request id, tokens, kept, added blocks]" if self.delta else "[request id, tokens, block table]"
        if not isinstance(entry, list) or len(entry) != (4 if self.delta else 3):
            raise _fail(where, f"must be {shape}")
        rid, tokens = _int(entry[0], f"{where}[0]"), _int(entry[1], f"{where}[1]", 1)
        added = _ints(entry[-1], f"{where}[{len(entry) - 1}]")
        if any(b >= self.num_blocks for b in added):
            raise _fail(f"{where}[{len(entry) - 1}]", f"holds a block id past num_blocks={self.num_blocks}")
        if not self.delta:
            return rid, tokens, added
        last = self.last.get(rid, [])
        kept = _int(entry[2], f"{where}[2]")
        if kept > len(last):
            raise _fail(f"{where}[2]", f"keeps {kept} blocks of a last recorded table of {len(last)}")
        table = last if kept == len(last) and not added else [*last[:kept], *added]
        self.last[rid] = table
        return rid, tokens, table

    def forget(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            self.last.pop(rid, None)


def _batch(value: Any, tables: Tables) -> list[tuple[int, int, list[int]]]:
    if not isinstance(value, list):
        raise _fail("batch", "must be a list of batch entries")
    return [tables.entry(entry, f"batch[{i}]") for i, entry in enumerate(value)]


def _step(obj: dict[str, Any], expected: int, tables: Tables) -> Step:
    number = _int(obj["step"], "step")
    if number < expected:
        raise _fail("step", f"is {number}, expected at least {expected} (step numbers increase, and a step "
                    "follows the arrivals recorded before it)")
    if obj.get("error") is not None:
        if obj["error"] != "empty decode":
            raise _fail("error", f"must be 'empty decode', got {obj['error']!r}"[:200])
        return Step(number, empty_decode=True)
    for key in STEP_KEYS:
        _key(obj, key, "step record")
    if not isinstance(obj["prefill"], bool):
        raise _fail("prefill", "must be true or false")
    batch = _batch(obj["batch"], tables)
    if not batch:
        raise _fail("batch", "must not be empty (a step with nothing to run is the empty decode)")
    preempted, wall = _ints(obj["preempted"], "preempted"), _wall(obj.get("wall"))
    if "failed" in obj:
        if not isinstance(obj["failed"], str):
            raise _fail("failed", "must be a string (why the step failed)")
        return Step(number, obj["prefill"], batch, preempted, failed=obj["failed"], wall=wall)
    # A discarded sample (an unfinished chunk's) may be the runner's placeholder: any int64.
    tokens = _ints(_key(obj, "tokens", "step record"), "tokens", INT64_MIN)
    if len(tokens) != len(batch):
        raise _fail("tokens", f"has {len(tokens)} tokens for a batch of {len(batch)}")
    finished = _ints(_key(obj, "finished", "step record"), "finished")
    return Step(number, obj["prefill"], batch, preempted, tokens, finished, wall=wall)


def _wall(value: Any) -> tuple[float, float] | None:
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
            or not 0 <= value[0] <= value[1]):
        raise _fail("wall", "must be [start, end] seconds with 0 <= start <= end")
    return float(value[0]), float(value[1])


class _Builder:
    """Collects a trace's events, validating each record against what came before it."""

    def __init__(self, config: dict[str, Any], eos_ids: list[int], version: int) -> None:
        self.trace = Trace(config, [], eos_ids)
        self.tables = Tables(version, config["num_blocks"])
        self.next = 0  # the least number the next step record may have
        self.following = 0  # the number of the step after the last step record: the one an abort precedes
        self.aborted_before: int | None = None  # the step the aborts since the last step record precede
        self.ids: dict[int, Request] = {}
        self.ended: dict[int, str] = {}  # request id -> how it ended ("finished", "aborted", "failed")
        self.wall_end = 0.0  # the last recorded step's end, in seconds

    def take(self, obj: Any) -> None:
        if not isinstance(obj, dict):
            raise _fail("record", "must be an object")
        if self.trace.events and isinstance(self.trace.events[-1], Step) and self.trace.events[-1].empty_decode:
            raise _fail("record", "follows the empty decode, which ends a trace (CONF-4)")
        if "add" in obj:
            added = _added(obj["add"], self.next)
            priority = _priority(obj["add"], self.trace.policy)
            self._add(dataclasses.replace(added, priority=priority))
            if priority:
                self.trace.priorities[added.id] = priority
        elif "abort" in obj:
            self._abort(obj)
        elif "cut" in obj:
            self._cut(obj)
        elif "step" in obj:
            self._step(_step(obj, self.next, self.tables))
        else:
            raise _fail("record", "must hold one of 'add', 'abort', 'cut', 'step'")

    def _step(self, step: Step) -> None:
        if not self.ids:
            raise _fail("step", f"step {step.step} comes before any request was added: there is nothing to schedule")
        if self.aborted_before is not None and step.step != self.aborted_before:
            raise _fail("step", f"is {step.step}, but the aborts before it were recorded before step "
                        f"{self.aborted_before}")
        if step.wall is not None:
            if step.wall[0] < self.wall_end:
                raise _fail("wall", f"starts at {step.wall[0]}, before the previous step's end {self.wall_end}")
            self.wall_end = step.wall[1]
        ended = [rid for rid, _, _ in step.batch] if step.failed is not None else step.finished
        self.tables.forget(ended)
        self.ended.update(dict.fromkeys(ended, "failed" if step.failed is not None else "finished"))
        self.trace.events.append(step)
        self.next = self.following = step.step + 1
        self.aborted_before = None

    def _add(self, added: Request) -> None:
        if added.id in self.ids:
            raise _fail("add.id", f"{added.id} was added before")
        self.ids[added.id] = added
        self.trace.events.append(added)
        self.next = added.arrive

    def _abort(self, obj: dict[str, Any]) -> None:
        rid = self._live(obj["abort"], "abort")
        before = _int(_key(obj, "before", "abort"), "abort.before")
        if before != self.following:
            raise _fail("abort.before", f"is {before}, but the next step is {self.following} (an abort is "
                        "recorded before the step that follows it)")
        self.trace.events.append(Aborted(rid, before))
        self.tables.forget([rid])
        self.ended[rid] = "aborted"
        self.aborted_before = before

    def _cut(self, obj: dict[str, Any]) -> None:
        rid = self._live(obj["cut"], "cut")
        asked = self.ids[rid].max_tokens
        lowered = _int(_key(obj, "max_tokens", "cut"), "cut.max_tokens", 1)
        if lowered > asked or rid in self.trace.cuts:
            raise _fail("cut.max_tokens", f"{lowered} must not exceed the asked {asked}, once per request")
        self.trace.cuts[rid] = lowered

    def _live(self, value: Any, what: str) -> int:
        """The id of a request added and not yet ended."""
        rid = _int(value, what)
        if rid not in self.ids:
            raise _fail(what, f"request {rid} was never added")
        if rid in self.ended:
            raise _fail(what, f"request {rid} was {self.ended[rid]} before")
        return rid


def read_trace(lines: list[bytes]) -> Trace:
    """The trace these lines hold (blank lines skipped); TraceError naming the line and field.

    A last line without its newline that is not JSON is a write cut short: it is dropped and reported in
    ``Trace.truncated``.
    """
    numbered = [(n, raw) for n, raw in enumerate(lines, start=1) if raw.strip()]
    if not numbered:
        raise TraceError("the trace is empty")
    builder: _Builder | None = None
    for index, (number, raw) in enumerate(numbered):
        try:
            obj = json_line(raw)
        except ValueError as e:
            if index == len(numbered) - 1 and not raw.endswith(b"\n") and builder is not None:
                builder.trace.truncated = (f"line {number} is cut short (the run ended mid-write); "
                                           f"the {number - 1} lines before it replay")
                break
            raise TraceError(f"line {number}: {e}") from None
        try:
            if builder is None:
                builder = _Builder(*parse_header(obj))
            else:
                builder.take(obj)
        except TraceError as e:
            raise TraceError(f"line {number}: {e}") from None
    assert builder is not None
    if not builder.trace.steps:
        raise TraceError("the trace holds no step: nothing to replay")
    return builder.trace


def read_trace_stream(stream: BinaryIO, first: list[bytes] | None = None) -> Trace:
    """``read_trace`` over a byte stream (``first``: lines already read from it), refusing a line over 1 MiB."""
    return read_trace(bounded_lines(stream, MAX_TRACE_BYTES, TraceError, "trace", first))


__all__ = ["VERSION", "Aborted", "Event", "Request", "Step", "Trace", "TraceError", "is_trace_header",
           "read_trace", "read_trace_stream"]
