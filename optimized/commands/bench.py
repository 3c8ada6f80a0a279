"""``nanoverify bench``: not built yet (placeholder until its issue lands)."""

from __future__ import annotations

import argparse
import sys

HELP = "bench (not implemented yet)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("rest", nargs=argparse.REMAINDER)


def main(args: argparse.Namespace) -> int:
    print("nanoverify bench: not implemented yet", file=sys.stderr)
    return 2
