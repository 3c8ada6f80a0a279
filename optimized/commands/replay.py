"""``nanoverify replay``: conformance workloads in, one ``{"trace": [...]}`` line out per workload."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from optimized.conformance import Workload, implementation, parse_workload, replay
from optimized.core.errors import WorkloadError

HELP = "replay conformance workloads (JSON lines with a 'workload' key) and print their traces"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--impl", choices=("reference", "optimized"), default="reference")
    p.add_argument("file", help="a JSON-lines file, or - for standard input")


def read_workloads(stream: TextIO) -> list[Workload]:
    """Every workload of the stream, validated before any is replayed."""
    workloads: list[Workload] = []
    for number, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        try:
            obj: Any = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"line {number}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or "workload" not in obj:
            continue
        try:
            workloads.append(parse_workload(obj["workload"]))
        except WorkloadError as e:
            raise WorkloadError(f"line {number}: {e}") from None
    return workloads


def main(args: argparse.Namespace) -> int:
    try:
        impl = implementation(args.impl)
    except NotImplementedError as e:
        print(f"nanoverify replay: {e}", file=sys.stderr)
        return 2
    try:
        if args.file == "-":
            workloads = read_workloads(sys.stdin)
        else:
            with open(args.file, encoding="utf-8") as f:
                workloads = read_workloads(f)
    except OSError as e:
        print(f"nanoverify replay: cannot read {args.file}: {e.strerror}", file=sys.stderr)
        return 2
    except WorkloadError as e:
        print(f"nanoverify replay: {e}", file=sys.stderr)
        return 2
    for workload in workloads:
        sys.stdout.write(json.dumps({"trace": replay(workload, impl)}) + "\n")
    return 0
