"""``nanoverify timeline``: draw a recorded trace, or a workload run through the reference first (TRACE-9, TRACE-10).

Writes ``OUT.json`` (Perfetto / Chrome trace events) and/or ``OUT.png`` beside
each other; ``OUT`` defaults to the input's path without its suffix, plus
``.timeline``. A bad input is one line and exit 2 (optimized/cli/command.py),
before anything is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from optimized.engine.arg_types import bounded_int

HELP = "draw a trace (or a workload, run through the reference) as a Perfetto timeline and/or a PNG"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a recorded trace (spec/trace.md) or a JSON-lines file of workloads, or - for "
                   "standard input")
    p.add_argument("-o", "--output", metavar="OUT", default=None,
                   help="writes OUT.json and/or OUT.png (default: the input's path less its suffix, + .timeline)")
    p.add_argument("--format", choices=("perfetto", "png", "both"), default="both")
    p.add_argument("--index", type=bounded_int(0), default=0,
                   help="which workload of a file holding several (0: the first)")
    p.add_argument("--axis", choices=("steps", "wall"), default="steps",
                   help="time axis: scheduler steps, or the recorded wall times (--trace-wall-times)")


def main(args: argparse.Namespace) -> int:
    from optimized.cli.replay import read_input
    from optimized.trace import timeline as draw
    from optimized.trace.schema import Trace
    from optimized.trace.workload import workload_trace

    loaded = read_input(args.file)
    if isinstance(loaded, Trace):
        trace = loaded
        if trace.truncated is not None:  # as replay says it (TRACE-4)
            print(f"nanoverify timeline: warning: {trace.truncated}", file=sys.stderr)
    else:
        if args.index >= len(loaded):
            raise ValueError(f"--index {args.index}: the input holds {len(loaded)} workloads")
        trace = workload_trace(loaded[args.index])
    if args.format != "perfetto":
        draw.require_matplotlib()
    out = Path(args.output) if args.output else _default_output(args.file)
    picture = draw.build_timeline(trace, args.axis)
    if picture.difference is not None:
        print(f"nanoverify timeline: warning: drawn up to the first difference from the reference "
              f"({picture.difference})", file=sys.stderr)
    if args.format in ("perfetto", "both"):
        Path(f"{out}.json").write_text(json.dumps(draw.perfetto(picture)), encoding="utf-8")
        print(f"{out}.json")
    if args.format in ("png", "both"):
        draw.png(picture, f"{out}.png", title=Path(args.file).name)
        print(f"{out}.png")
    return 0


def _default_output(name: str) -> Path:
    if name == "-":
        return Path("timeline")
    return Path(name).with_suffix("").with_name(Path(name).with_suffix("").name + ".timeline")
