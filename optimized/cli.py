"""The ``nanoverify`` command: one subcommand per module under optimized/commands.

Each command module exposes ``HELP``, ``add_arguments(parser)`` and
``main(args) -> int``; heavy imports (torch, transformers) happen inside
``main`` so that ``nanoverify replay`` starts in a blink.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from optimized.commands import bench, conformance, fuzz, generate, gpu_check, replay, run

COMMANDS = {
    "run": run,
    "replay": replay,
    "conformance": conformance,
    "fuzz": fuzz,
    "bench": bench,
    "generate": generate,
    "gpu-check": gpu_check,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoverify", description="A small inference engine with a proven scheduler.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(handler=module.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
