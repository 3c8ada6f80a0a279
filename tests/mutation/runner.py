"""Runs the judging tests against each mutant in a copy of the tree and scores the run (spec/mutation.md).

Invariant: the source tree is never written. The copy (the workspace,
``mutants/`` by default, git-ignored) gets one mutant at a time and the
original back before the next; the tests run there in a fresh interpreter,
``pytest -x`` with a fixed hypothesis seed and an empty hypothesis database,
so that a mutant's outcome depends on the mutant and the seed alone (MUT-1).
A mutant is killed when the tests fail (or cannot even start), and killed by
timeout when they run past the per-mutant limit; else it survived (MUT-3).
The unmutated copy must pass first, or nothing is scored (MUT-4).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tests.mutation.explained import explanation
from tests.mutation.mutants import Mutant

_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)
_IGNORED = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.pyc", "mutants")


class BaselineFailed(RuntimeError):
    """The tests fail on the unmutated copy: a score would mean nothing."""


@dataclass(frozen=True)
class Outcome:
    mutant: Mutant
    status: str  # "killed", "timeout", "survived", or "explained" (survived, and listed in explained.py)
    seconds: float
    killer: str = ""  # the first failing test, when pytest named one
    why: str = ""  # the reason an explained survivor may survive

    @property
    def killed(self) -> bool:
        return self.status in ("killed", "timeout")


@dataclass
class Score:
    """Killed / scored, per file and overall (explained survivors are not scored); the survivors in file order."""

    outcomes: list[Outcome] = field(default_factory=list)

    def per_file(self) -> dict[str, tuple[int, int]]:
        table: dict[str, tuple[int, int]] = {}
        for o in self.scored:
            killed, total = table.get(o.mutant.path, (0, 0))
            table[o.mutant.path] = (killed + o.killed, total + 1)
        return table

    @property
    def scored(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status != "explained"]

    @property
    def killed(self) -> int:
        return sum(o.killed for o in self.outcomes)

    @property
    def ratio(self) -> float:
        scored = len(self.scored)
        return self.killed / scored if scored else 1.0

    @property
    def survivors(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "survived"]

    @property
    def explained(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "explained"]


@dataclass(frozen=True)
class Workspace:
    """One copy of the tree that runs one mutant at a time."""

    root: Path
    command: tuple[str, ...]  # the test command, the test files appended

    @classmethod
    def copy_of(cls, source: Path, root: Path, copied: Iterable[str], command: tuple[str, ...]) -> Workspace:
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        for name in copied:
            src = source / name
            if src.is_dir():
                shutil.copytree(src, root / name, ignore=_IGNORED)
            elif src.exists():
                shutil.copy2(src, root / name)
        return cls(root, command)

    def run_tests(self, timeout: float) -> tuple[int | None, str, float]:
        """The tests here: (exit status or None at the timeout, output, seconds)."""
        shutil.rmtree(self.root / ".hypothesis", ignore_errors=True)
        env = {**os.environ, "PYTHONPATH": str(self.root), "PYTHONDONTWRITEBYTECODE": "1"}
        began = time.monotonic()
        try:
            done = subprocess.run(self.command, cwd=self.root, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, "", time.monotonic() - began
        return done.returncode, done.stdout + done.stderr, time.monotonic() - began

    def judge(self, mutant: Mutant, timeout: float) -> Outcome:
        """The tests against ``mutant``; the file is restored whatever happens."""
        target = self.root / mutant.path
        original = target.read_bytes()
        target.write_bytes(mutant.apply(original))
        try:
            status, output, seconds = self.run_tests(timeout)
        finally:
            target.write_bytes(original)
        if status is None:
            return Outcome(mutant, "timeout", seconds)
        if status == 0:
            return Outcome(mutant, "survived", seconds)
        first = _FAILED.search(output)
        return Outcome(mutant, "killed", seconds, first.group(1) if first else f"pytest exit {status}")


def pytest_command(tests: Iterable[str], seed: int) -> tuple[str, ...]:
    """pytest -x over ``tests`` in a fresh interpreter, hypothesis seeded with ``seed``."""
    return (sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", f"--hypothesis-seed={seed}",
            *tests)


def check_command(full_every: int | None, seed: int) -> tuple[str, ...]:
    """Check mode as the judge (tests/mutation/check_killer.py) in a fresh interpreter, whole states compared
    every ``full_every`` steps (the shadow's default when None)."""
    every = () if full_every is None else ("--check-full-every", str(full_every))
    return (sys.executable, "-m", "tests.mutation.check_killer", *every, "--seed", str(seed))


def run(source: Path, mutants: list[Mutant], command: tuple[str, ...], copied: Iterable[str], *, workspace: Path,
        jobs: int = 1, timeout: float | None = None, report: Callable[[str], None] = print,
        explain: Callable[[Mutant, list[str]], str] = explanation) -> Score:
    """Copy the tree ``jobs`` times, check the unmutated tests pass, then judge every mutant (in file order).

    A survivor that ``explain`` gives a reason for is marked explained (MUT-6).
    """
    lines = {path: (source / path).read_text().splitlines() for path in {m.path for m in mutants}}
    spaces = [Workspace.copy_of(source, workspace / f"w{i}", copied, command) for i in range(max(1, jobs))]
    status, output, baseline = spaces[0].run_tests(timeout=3600)
    if status != 0:
        raise BaselineFailed(f"the tests fail without any mutant (exit {status}):\n{output[-3000:]}")
    limit = timeout if timeout is not None else max(60.0, 3 * baseline)
    report(f"baseline: tests pass in {baseline:.1f}s; per-mutant timeout {limit:.0f}s; {len(mutants)} mutants")
    free = list(spaces)
    lock = threading.Lock()

    def judge(index_and_mutant: tuple[int, Mutant]) -> Outcome:
        index, mutant = index_and_mutant
        with lock:
            space = free.pop()
        try:
            outcome = space.judge(mutant, limit)
        finally:
            with lock:
                free.append(space)
        why = explain(mutant, lines[mutant.path]) if outcome.status == "survived" else ""
        if why:
            outcome = Outcome(mutant, "explained", outcome.seconds, why=why)
        with lock:
            report(f"[{index + 1}/{len(mutants)}] {outcome.status:8} {outcome.seconds:5.1f}s  {mutant.describe()}"
                   + (f"  ({outcome.killer})" if outcome.killer else ""))
        return outcome

    with ThreadPoolExecutor(max_workers=len(spaces)) as pool:
        outcomes = list(pool.map(judge, enumerate(mutants)))
    return Score(outcomes)


def verdict(score: Score, min_score: float) -> int:
    """The exit status: 0 when at least ``min_score`` of the mutants were killed (MUT-5), else 1."""
    return 0 if score.ratio >= min_score else 1


def summary(score: Score) -> list[str]:
    """The score per file and overall, then every survivor."""
    lines = [f"{path}: {killed}/{total} killed" for path, (killed, total) in score.per_file().items()]
    explained = score.explained
    lines.append(f"score: {score.killed}/{len(score.scored)} killed ({100 * score.ratio:.1f}%)"
                 + (f", {len(explained)} explained survivors not scored" if explained else ""))
    timeouts = sum(o.status == "timeout" for o in score.outcomes)
    if timeouts:
        lines.append(f"  ({timeouts} of them by timeout)")
    if explained:
        lines.append(f"explained survivors: {len(explained)}")
        lines.extend(f"  {o.mutant.describe()}  [{o.why}]" for o in explained)
    lines.append(f"survivors: {len(score.survivors)}")
    lines.extend(f"  {o.mutant.describe()}" for o in score.survivors)
    return lines
