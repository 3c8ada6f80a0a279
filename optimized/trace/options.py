"""The ``--trace FILE`` and ``--trace-wall-times`` flags every engine command shares (TRACE-1)."""

from __future__ import annotations

import argparse
from typing import Any


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="record the run in FILE as it happens (spec/trace.md); replay it with nanoverify replay")
    p.add_argument("--trace-wall-times", action="store_true", help="with --trace: record each step's wall times")


def trace_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``LLM`` keyword arguments the flags ask for."""
    if args.trace_wall_times and args.trace is None:
        raise ValueError("--trace-wall-times needs --trace FILE")
    return {"trace": args.trace, "trace_wall_times": args.trace_wall_times}
