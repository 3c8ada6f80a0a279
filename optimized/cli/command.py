"""The ``nanoverify`` command: one subcommand per module beside this one.

Bad input never gives a traceback: a bad argument, a ``ValueError`` or an
``OSError`` from any subcommand is one line on standard error, ``nanoverify
<command>: <message>``, and exit status 2 (spec/cli.md, CLI-1, CLI-2); running out of memory is one line and
exit status 3, never 1, which means a run diverged (CLI-8). A reader
that closes standard output early ends the command quietly with status 141
(CLI-3); Ctrl-C ends it with 130 (CLI-4).

Each command module exposes ``HELP``, ``add_arguments(parser)`` and
``main(args) -> int``; heavy imports (torch, transformers) happen inside
``main`` so that ``nanoverify replay`` starts in a blink.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from optimized.cli import bench, conformance, fuzz, generate, gpu_check, replay, run, serve, timeline

COMMANDS = {
    "run": run,
    "replay": replay,
    "conformance": conformance,
    "fuzz": fuzz,
    "bench": bench,
    "generate": generate,
    "gpu-check": gpu_check,
    "timeline": timeline,
    "serve": serve,
}
BAD_INPUT = 2
OUT_OF_MEMORY = 3  # our own failure, never 1 (a replay's or a check's "diverged")
BROKEN_PIPE = 128 + 13  # what a shell reports for a command ended by SIGPIPE
INTERRUPTED = 128 + 2  # ... and by SIGINT


class UsageError(Exception):
    """A command line argparse refused; its message is one line."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block) and raise instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser() -> Parser:
    parser = Parser(prog="nanoverify", description="A small inference engine with a proven scheduler.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(handler=module.main)
    return parser


def one_line(error: BaseException) -> str:
    """The error as one line: an OSError as 'file: reason', anything else as its message."""
    if isinstance(error, OSError) and error.strerror:
        text = f"{error.filename}: {error.strerror}" if error.filename is not None else error.strerror
    else:
        text = str(error) or type(error).__name__
    return " ".join(text.split())


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args, extra = build_parser().parse_known_args(argv)
    except UsageError as e:
        print(one_line(e), file=sys.stderr)
        return BAD_INPUT
    command = " ".join(filter(None, ("nanoverify", args.command, getattr(args, "bench", None))))
    if extra:  # named by the subcommand they were given to, not by the top-level parser
        print(one_line(UsageError(f"{command}: unrecognized arguments: {' '.join(extra)} (see {command} --help)")),
              file=sys.stderr)
        return BAD_INPUT
    try:
        code: int = args.handler(args)
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
        return BROKEN_PIPE
    except (ValueError, OSError) as e:
        print(f"{command}: {one_line(e)}", file=sys.stderr)
        return BAD_INPUT
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except MemoryError:
        print(f"{command}: out of memory (the machine, or a ulimit, holds less than this command needs)",
              file=sys.stderr)
        return OUT_OF_MEMORY
    return code


def _silence_stdout() -> None:
    """Point standard output at /dev/null, so that the interpreter's last flush at exit cannot fail again.

    Python's documented recipe for SIGPIPE (the ``signal`` module's notes on BrokenPipeError).
    """
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (a test's capture): nothing will flush at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
