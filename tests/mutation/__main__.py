"""``python -m tests.mutation [--sample N] [--seed S] ...``: the mutation run over targets.py's files and tests.

Prints one line per mutant as it is judged, then the score per file and
overall and every surviving mutant (file:line, the edit). Exit status 0 when
the score reaches ``--min-score`` (MUT-5), 1 below it, 2 when the tests fail
without any mutant or a target file is missing. ``--killer check`` judges
each mutant by check mode instead of the tests (spec/check.md, CHECK-6): the
optimized core's files only, every survivor listed (explained.py's reasons
are the tests'). ``--policies`` mutates the scheduling policies instead,
judged by the policy tests (targets.py's groups); ``--only FILE`` judges each
file with its own group's tests.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tests.mutation import targets
from tests.mutation.mutants import Mutant, find_mutants, sample
from tests.mutation.runner import BaselineFailed, Score, check_command, pytest_command, run, summary, verdict

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
    p.add_argument("--policies", action="store_true",
                   help="mutate the scheduling policies (targets.py's POLICY_TARGETS), judged by the policy tests")
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
    if args.policies and args.killer == "check":
        p.error("--policies needs --killer tests")
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    return args


def _unexplained(mutant: Mutant, lines: list[str]) -> str:
    """No reason: explained.py's reasons say why the tests cannot see a mutant, not why check mode cannot."""
    return ""


def _groups(args: argparse.Namespace) -> list[tuple[list[str], tuple[str, ...]]]:
    """The files to mutate, each group's with the tests that judge them: the default run is the core group,
    ``--policies`` the policy group; ``--only`` picks files of any group (of CHECK_TARGETS with check mode)."""
    if args.killer == "check":
        return [(list(targets.CHECK_TARGETS), ())]
    name = "policies" if args.policies else "core"
    return [(list(files), tests) for group, files, tests in targets.GROUPS if args.only or group == name]


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    args = _arguments(argv)
    by_check = args.killer == "check"
    groups = [(files if args.only is None else [f for f in files if f in args.only], tests)
              for files, tests in _groups(args)]
    groups = [(files, tests) for files, tests in groups if files]
    files = [f for group_files, _ in groups for f in group_files]
    missing = [f for f in files if not (root / f).is_file()]
    if missing or (args.only and len(files) != len(args.only)):
        print(f"mutation: no such target {missing or args.only}; the targets are listed in tests/mutation/"
              f"targets.py{' (CHECK_TARGETS with --killer check)' if by_check else ''}", file=sys.stderr)
        return 2
    judged = [([m for f in group_files for m in sample(find_mutants(f, (root / f).read_bytes()), args.sample,
                                                          args.seed)], tests) for group_files, tests in groups]
    if args.list:
        print("\n".join(m.describe() for mutants, _ in judged for m in mutants))
        return 0
    began = time.monotonic()
    score = Score()
    try:
        for mutants, tests in judged:
            if by_check:
                part = run(root, mutants, check_command(args.check_full_every, args.seed), targets.COPIED,
                           workspace=args.workspace, jobs=args.jobs, timeout=args.timeout, explain=_unexplained)
            else:
                part = run(root, mutants, pytest_command(tests, args.seed), targets.COPIED,
                           workspace=args.workspace, jobs=args.jobs, timeout=args.timeout)
            score.outcomes.extend(part.outcomes)
    except BaselineFailed as e:
        print(f"mutation: {e}", file=sys.stderr)
        return 2
    print("\n".join(summary(score)))
    judge = f" --killer check --check-full-every {args.check_full_every or 32}" if by_check else ""
    group = " --policies" if args.policies else ""
    print(f"took {time.monotonic() - began:.0f}s (--sample {args.sample} --seed {args.seed}{group}{judge})")
    return verdict(score, args.min_score)

if __name__ == "__main__":
    sys.exit(main())
