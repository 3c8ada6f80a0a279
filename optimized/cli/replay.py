"""``nanoverify replay``: conformance workloads in, one ``{"trace": [...]}`` line out per workload.

The whole input is read and validated before anything is replayed (CONF-6): a bad
line, whatever its bytes, is one line on standard error and exit 2 with nothing on
standard output; the reader's limits are spec/cli.md's CLI-7.
"""

from __future__ import annotations

import argparse
import json
import sys

from optimized.verify.conformance import Workload, implementation, read_workloads, replay

HELP = "replay conformance workloads (JSON lines with a 'workload' key) and print their traces"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--impl", choices=("reference", "optimized"), default="reference")
    p.add_argument("file", help="a JSON-lines file (UTF-8, at most 64 MiB, lines of at most 1 MiB), or - for "
                   "standard input")


def read_input(name: str) -> list[Workload]:
    """The workloads of file ``name`` ('-': standard input); WorkloadError or OSError when unreadable."""
    if name != "-":
        with open(name, "rb") as f:
            return read_workloads(f)
    if sys.stdin is None:  # started with standard input closed (<&-)
        raise OSError(0, "standard input is closed")
    return read_workloads(sys.stdin.buffer)


def main(args: argparse.Namespace) -> int:
    impl = implementation(args.impl)
    # WorkloadError (a ValueError) and OSError are one line and exit 2 by optimized/cli/command.py.
    workloads = read_input(args.file)
    for workload in workloads:
        sys.stdout.write(json.dumps({"trace": replay(workload, impl)}) + "\n")
    return 0
