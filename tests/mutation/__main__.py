"""``python -m tests.mutation [--sample N] [--seed S] ...``: the mutation run over targets.py's files and tests.

Prints one line per mutant as it is judged, then the score per file and
overall and every surviving mutant (file:line, the edit). Exit status 0 when
the score reaches ``--min-score`` (MUT-5), 1 below it, 2 when the tests fail
without any mutant or a target file is missing. ``--killer check`` judges
each mutant by check mode instead of the tests (spec/check.md, CHECK-6): the
optimized core's files only, every survivor listed (explained.py's reasons
are the tests').
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tests.mutation import targets
from tests.mutation.mutants import Mutant, find_mutants, sample
from tests.mutation.runner import BaselineFailed, check_command, pytest_command, run, summary, verdict

ROOT = Path(__file__).resolve().parents[2]
MIN_SCORE = 0.95


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mutation", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--sample", type=int, default=None, metavar="N", help="mutants per file, drawn from the seed "
                   "(default: every mutant)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sample and of hypothesis (default 0)")
    p.add_argument("--jobs", type=int, default=1, help="mutants judged at once, each in its own copy (default 1)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per mutant (default: 3x the clean run)")
    p.add_argument("--min-score", type=float, default=MIN_SCORE, help=f"fraction to kill (default {MIN_SCORE})")
    p.add_argument("--only", action="append", default=None, metavar="PATH",
                   help="mutate only this target file (repeatable)")
    p.add_argument("--list", action="store_true", help="print the sampled mutants and stop")
    p.add_argument("--workspace", type=Path, default=ROOT / "mutants", help="the copies' folder (default mutants/)")
    p.add_argument("--killer", choices=("tests", "check"), default="tests",
                   help="what judges a mutant: the scheduler tests (default), or check mode over "
                   "tests/mutation/check_killer.py's workloads, on the optimized core's files")
    p.add_argument("--check-full-every", type=int, default=None, metavar="K",
                   help="with --killer check: steps between full comparisons (default 32)")
    args = p.parse_args(argv)
    if args.check_full_every is not None and args.killer != "check":
        p.error("--check-full-every needs --killer check")
    if args.check_full_every is not None and args.check_full_every < 1:
        p.error(f"--check-full-every must be at least 1, got {args.check_full_every}")
    if args.sample is not None and args.sample < 1:
        p.error(f"--sample must be at least 1, got {args.sample}")
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    return args


def _unexplained(mutant: Mutant, lines: list[str]) -> str:
    """No reason: explained.py's reasons say why the tests cannot see a mutant, not why check mode cannot."""
    return ""


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    args = _arguments(argv)
    by_check = args.killer == "check"
    pool = targets.CHECK_TARGETS if by_check else targets.TARGETS
    files = [f for f in pool if args.only is None or f in args.only]
    missing = [f for f in files if not (root / f).is_file()]
    if missing or (args.only and len(files) != len(args.only)):
        print(f"mutation: no such target {missing or args.only}; the targets are listed in tests/mutation/"
              f"targets.py{' (CHECK_TARGETS with --killer check)' if by_check else ''}", file=sys.stderr)
        return 2
    mutants = [m for f in files for m in sample(find_mutants(f, (root / f).read_bytes()), args.sample, args.seed)]
    if args.list:
        print("\n".join(m.describe() for m in mutants))
        return 0
    began = time.monotonic()
    try:
        if by_check:
            score = run(root, mutants, check_command(args.check_full_every, args.seed), targets.COPIED,
                        workspace=args.workspace, jobs=args.jobs, timeout=args.timeout, explain=_unexplained)
        else:
            score = run(root, mutants, pytest_command(targets.TESTS, args.seed), targets.COPIED,
                        workspace=args.workspace, jobs=args.jobs, timeout=args.timeout)
    except BaselineFailed as e:
        print(f"mutation: {e}", file=sys.stderr)
        return 2
    print("\n".join(summary(score)))
    judge = f" --killer check --check-full-every {args.check_full_every or 32}" if by_check else ""
    print(f"took {time.monotonic() - began:.0f}s (--sample {args.sample} --seed {args.seed}{judge})")
    return verdict(score, args.min_score)


if __name__ == "__main__":
    sys.exit(main())
