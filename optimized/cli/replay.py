"""``nanoverify replay``: conformance workloads in, one ``{"trace": [...]}`` line out per workload; or a recorded
trace in, its decisions reproduced step by step (TRACE-6).

The whole input is read and validated before anything is replayed (CONF-6): a bad
line, whatever its bytes, is one line on standard error and exit 2 with nothing on
standard output; the reader's limits are spec/cli.md's CLI-7. An input whose first
record is a trace header (``{"version": ...}``, spec/trace.md) is a recorded run:
it is replayed through ``--impl`` with invariants checked at every step, and the
command prints ``identical: N/N steps`` (with the trace's policy when it is not the
lesson's: both implementations of that policy judge it) (exit 0) or, after the count of identical
steps, the first differing step and field (exit 1).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from typing import BinaryIO

from optimized.trace.replay import replay_trace
from optimized.trace.schema import Trace, TraceError, is_trace_header, read_trace_stream
from optimized.verify.conformance import (
    MAX_INPUT_BYTES,
    MAX_LINE_BYTES,
    Workload,
    _json_line,
    implementation,
    read_workloads,
    replay,
)

HELP = "replay conformance workloads and print their traces, or replay a recorded trace and compare every step"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--impl", choices=("reference", "optimized"), default="reference")
    p.add_argument("file", help="a JSON-lines file of workloads (UTF-8, at most 64 MiB, lines of at most 1 MiB) or a "
                   "recorded trace (spec/trace.md), or - for standard input")


def _first_record(stream: BinaryIO) -> tuple[list[bytes], bool]:
    """The lines up to the first non-blank one, and whether that one is a trace header."""
    lines: list[bytes] = []
    while line := stream.readline(MAX_LINE_BYTES + 1):
        lines.append(line)
        if line.strip():
            try:
                return lines, is_trace_header(_json_line(line))
            except ValueError:
                return lines, False  # the workload reader names what is wrong with it
    return lines, False


def read_stream(stream: BinaryIO) -> list[Workload] | Trace:
    first, is_trace = _first_record(stream)
    if is_trace:
        return read_trace_stream(stream, first)
    # The rest is read up to one byte past the reader's limit, so the limit is still the reader's to enforce.
    workloads = read_workloads(io.BytesIO(b"".join(first) + stream.read(MAX_INPUT_BYTES + 1)))
    if not workloads:  # CLI-7, TRACE-5: no silent success on nothing
        if not first or not first[-1].strip():
            raise TraceError("the input is empty (or blank lines only): nothing to replay")
        raise TraceError("no line holds a workload, and the first is no trace header: nothing to replay")
    return workloads


def read_input(name: str) -> list[Workload] | Trace:
    """The workloads, or the trace, of file ``name`` ('-': standard input); ValueError or OSError when unreadable."""
    if name != "-":
        try:
            with open(name, "rb") as f:
                return read_stream(f)
        except OSError as error:
            if error.filename is None:  # a read that failed (/proc/self/mem: EIO) names no file: CLI-1 needs it
                error.filename = name
            raise
    if sys.stdin is None:  # started with standard input closed (<&-)
        raise OSError(0, "standard input is closed")
    return read_stream(sys.stdin.buffer)


def policy_note(trace: Trace) -> str:
    """The policy a trace was judged under, when it is not the lesson's (whose line TRACE-6 keeps as it was)."""
    policy = trace.policy
    if policy == "lesson":
        return ""
    return f" (policy {policy}, patience {trace.config.get('patience')})" if policy == "lpm" else f" (policy {policy})"


def replay_recorded(trace: Trace, impl: str) -> int:
    """TRACE-6: replay a recorded run; 0 when every step is identical, 1 at the first difference."""
    if trace.truncated is not None:
        print(f"nanoverify replay: warning: {trace.truncated}", file=sys.stderr)
    outcome = replay_trace(trace, impl)
    print(f"identical: {outcome.identical}/{outcome.steps} steps{policy_note(trace)}")
    if outcome.difference is not None:
        print(f"first difference: {outcome.difference}")
        return 1
    return 0


def main(args: argparse.Namespace) -> int:
    impl = implementation(args.impl)
    # WorkloadError, TraceError (ValueErrors) and OSError are one line and exit 2 by optimized/cli/command.py.
    loaded = read_input(args.file)
    if isinstance(loaded, Trace):
        return replay_recorded(loaded, args.impl)
    for workload in loaded:
        sys.stdout.write(json.dumps({"trace": replay(workload, impl)}) + "\n")
    return 0
