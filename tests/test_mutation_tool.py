"""MUT-1..MUT-7: the mutation tool (tests/mutation/) on tiny files and a planted survivor.

The mutator's edits are checked on a few lines of code; the runner on a
two-file project in a temporary folder whose test leaves one mutant alive.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.mutation import targets
from tests.mutation.__main__ import _arguments, _groups, main
from tests.mutation.explained import EXPLAINED, explanation
from tests.mutation.mutants import Mutant, find_mutants, sample
from tests.mutation.runner import BaselineFailed, Outcome, Score, pytest_command, run, summary, verdict

TINY = b'''"""A docstring is never mutated."""
from __future__ import annotations

__all__ = ["f"]


def f(x: int, flag: bool = True) -> int:
    """Nor is this one."""
    assert x >= 0
    y = x + 1
    if y > 2 and not flag:
        return y
    total = 0
    for i in range(x):
        if i == 3:
            break
        total += i
    return total  # pragma: no mutate
'''


def _edits(source: bytes) -> list[str]:
    return [f"{m.line} {m.kind}: {m.before} -> {m.after}" for m in find_mutants("tiny.py", source)]


@pytest.mark.clause("MUT-1")
@pytest.mark.parametrize("seed", [0, 1])
def test_mutants_are_found_in_file_order_and_sampled_reproducibly(seed: int) -> None:
    """MUT-1: the same text and seed give the same mutants and the same sample; the sample keeps file order."""
    source = Path("optimized/core/free_queue.py").read_bytes()
    every = find_mutants("optimized/core/free_queue.py", source)
    assert every == find_mutants("optimized/core/free_queue.py", source)
    assert [m.start for m in every] == sorted(m.start for m in every)
    picked = sample(every, 10, seed)
    assert picked == sample(every, 10, seed) and len(picked) == 10
    assert [every.index(m) for m in picked] == sorted(every.index(m) for m in picked)
    assert sample(every, 10, seed) != sample(every, 10, seed + 2)  # another seed, another draw
    assert sample(every, len(every) + 5, seed) == every


@pytest.mark.clause("MUT-2")
def test_the_edits_on_a_tiny_file() -> None:
    """MUT-2: one edit per mutant, of mutmut's kinds; docstrings, asserts, annotations, __all__ and pragmas kept."""
    assert _edits(TINY) == [
        "7 constant: True -> False",
        "10 delete: y = x + 1 -> pass",
        "10 operator: x + 1 -> (x - 1)",
        "10 constant: 1 -> 2",
        "11 comparison: y > 2 -> (y >= 2)",
        "11 boolean: y > 2 and not flag -> (y > 2 or not flag)",
        "11 constant: 2 -> 3",
        "11 boolean: not flag -> (flag)",
        "13 delete: total = 0 -> pass",
        "13 constant: 0 -> 1",
        "15 comparison: i == 3 -> (i != 3)",
        "15 constant: 3 -> 4",
        "16 loop: break -> continue",
        "17 delete: total += i -> pass",
        "17 operator: total += i -> total -= i",
    ]


@pytest.mark.clause("MUT-2")
def test_each_mutant_changes_the_code_and_compiles() -> None:
    """MUT-2: applying a mutant changes exactly its span, and the result compiles."""
    for m in find_mutants("tiny.py", TINY):
        mutated = m.apply(TINY)
        compile(mutated, "tiny.py", "exec")
        assert mutated[: m.start] == TINY[: m.start] and mutated.endswith(TINY[m.end :])


def _tiny_project(root: Path) -> None:
    """calc.py and a test that checks ``double`` fully but ``clamp`` only above its bound."""
    root.mkdir()
    (root / "calc.py").write_text(
        "def double(x):\n    return x * 2\n\n\ndef clamp(x):\n    return 9 if x >= 9 else x\n")
    (root / "test_calc.py").write_text(
        "from calc import clamp, double\n\n\ndef test_calc():\n    assert double(3) == 6\n    assert clamp(12) == 9\n")


@pytest.mark.clause("MUT-3", "MUT-7")
def test_a_planted_survivor_is_reported_and_the_tree_is_untouched(tmp_path: Path) -> None:
    """MUT-3, MUT-7: a mutant the test misses survives and is listed, a caught one is killed; sources unchanged."""
    source = tmp_path / "project"
    _tiny_project(source)
    before = (source / "calc.py").read_bytes()
    mutants = [m for m in find_mutants("calc.py", before) if m.line == 6][:2]
    lines: list[str] = []
    score = run(source, mutants, pytest_command(["test_calc.py"], 0), ("calc.py", "test_calc.py"),
                workspace=tmp_path / "mutants", report=lines.append)
    assert lines[0].startswith("baseline: tests pass")
    assert [(o.mutant.describe(), o.status) for o in score.outcomes] == [
        ("calc.py:6 constant: `9` -> `10`", "killed"),  # clamp(12) is 10
        ("calc.py:6 comparison: `x >= 9` -> `(x > 9)`", "survived"),  # the test never asks clamp(9)
    ]
    assert score.outcomes[0].killer == "test_calc.py::test_calc"
    report = summary(score)
    assert "score: 1/2 killed (50.0%)" in report
    assert report[-2:] == ["survivors: 1", "  calc.py:6 comparison: `x >= 9` -> `(x > 9)`"]
    assert (source / "calc.py").read_bytes() == before
    assert (tmp_path / "mutants" / "w0" / "calc.py").read_bytes() == before  # restored after each mutant


def _plain(test_file: str) -> tuple[str, ...]:
    """A test command without pytest's start-up: the test file is a script that raises on failure."""
    return (sys.executable, test_file)


@pytest.mark.clause("MUT-3")
def test_a_hanging_mutant_is_killed_by_the_timeout(tmp_path: Path) -> None:
    """MUT-3: tests that run past the per-mutant limit count as a kill, by timeout."""
    source = tmp_path / "project"
    source.mkdir()
    (source / "loop.py").write_text("def wait(n):\n    while n > 0:\n        n -= 1\n")
    (source / "check.py").write_text("from loop import wait\n\nwait(3)\n")
    hang = next(m for m in find_mutants("loop.py", (source / "loop.py").read_bytes()) if m.after == "n += 1")
    score = run(source, [hang], _plain("check.py"), ("loop.py", "check.py"), workspace=tmp_path / "mutants",
                timeout=1, report=lambda _line: None)
    assert [o.status for o in score.outcomes] == ["timeout"] and score.ratio == 1.0


@pytest.mark.clause("MUT-4")
def test_no_score_when_the_tests_fail_without_a_mutant(tmp_path: Path) -> None:
    """MUT-4: a failing clean run stops the tool before any mutant is judged."""
    source = tmp_path / "project"
    _tiny_project(source)
    (source / "check.py").write_text("from calc import double\n\nassert double(2) == 5\n")
    with pytest.raises(BaselineFailed, match="without any mutant"):
        run(source, find_mutants("calc.py", (source / "calc.py").read_bytes()), _plain("check.py"),
            ("calc.py", "check.py"), workspace=tmp_path / "mutants", report=lambda _line: None)


@pytest.mark.clause("MUT-5")
def test_the_score_threshold_and_the_exit_status() -> None:
    """MUT-5: below --min-score (95% by default) the run fails; at or above it, it passes."""
    assert verdict(Score(), 0.95) == 0
    killed = _outcomes(19, "killed") + _outcomes(1, "survived")
    assert verdict(Score(killed), 0.95) == 0
    assert verdict(Score(_outcomes(18, "killed") + _outcomes(2, "survived")), 0.95) == 1


def _outcomes(n: int, status: str) -> list[Outcome]:
    mutant = find_mutants("tiny.py", TINY)[0]
    return [Outcome(mutant, status, 0.0) for _ in range(n)]


@pytest.mark.clause("MUT-1", "MUT-5")
def test_the_targets_exist_and_the_command_lists_its_sample(capsys: pytest.CaptureFixture[str]) -> None:
    """MUT-1, MUT-5: every target and test named in targets.py exists; --list prints N mutants per file."""
    for path in (*targets.TARGETS, *targets.TESTS, *targets.POLICY_TARGETS, *targets.POLICY_TESTS):
        assert Path(path).is_file(), f"{path} moved: update tests/mutation/targets.py"
    assert main(["--list", "--sample", "2", "--seed", "3", "--only", "reference/scheduler.py"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 2 and all(line.startswith("reference/scheduler.py:") for line in listed)
    assert main(["--list", "--only", "reference/nowhere.py"]) == 2


@pytest.mark.clause("MUT-5")
def test_the_script_runs_the_tool() -> None:
    """MUT-5: scripts/mutation.sh is the entry point; it passes its arguments on."""
    done = subprocess.run(["bash", "scripts/mutation.sh", "--list", "--sample", "1", "--only", "reference/config.py"],
                          capture_output=True, text=True, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("reference/config.py:") and len(done.stdout.splitlines()) == 1


@pytest.mark.clause("MUT-6")
def test_an_explained_survivor_is_listed_with_its_reason_and_not_scored(tmp_path: Path) -> None:
    """MUT-6: a survivor the explanations name is reported with its reason and left out of the score."""
    source = tmp_path / "project"
    _tiny_project(source)
    (source / "check.py").write_text("from calc import double\n\nassert double(3) == 6\n")
    mutants = [m for m in find_mutants("calc.py", (source / "calc.py").read_bytes()) if m.line == 6]

    def explain(mutant: Mutant, lines: list[str]) -> str:
        assert lines[mutant.line - 1].strip() == "return 9 if x >= 9 else x"
        return "equivalent: planted" if mutant.kind == "comparison" else ""

    score = run(source, mutants, _plain("check.py"), ("calc.py", "check.py"), workspace=tmp_path / "mutants",
                report=lambda _line: None, explain=explain)
    assert [o.status for o in score.outcomes] == ["survived", "explained", "survived"]
    assert (score.killed, len(score.scored)) == (0, 2)
    report = summary(score)
    assert "score: 0/2 killed (0.0%), 1 explained survivors not scored" in report
    assert "  calc.py:6 comparison: `x >= 9` -> `(x > 9)`  [equivalent: planted]" in report


@pytest.mark.clause("MUT-6")
def test_every_explanation_names_a_mutant_of_the_current_code() -> None:
    """MUT-6: no stale entry: each explained survivor still exists in its file (update explained.py on a move)."""
    mutants = {path: find_mutants(path, Path(path).read_bytes()) for path in {e.path for e in EXPLAINED}}
    lines = {path: Path(path).read_text().splitlines() for path in mutants}
    for entry in EXPLAINED:
        matches = [m for m in mutants[entry.path] if explanation(m, lines[entry.path], (entry,))]
        assert matches, f"no mutant of {entry.path} matches {entry}"
        assert entry.why.startswith(("equivalent: ", "dead code: "))


@pytest.mark.clause("MUT-10")
def test_the_policies_are_their_own_group_judged_by_the_policy_tests(capsys: pytest.CaptureFixture[str]) -> None:
    """MUT-10: --policies mutates the policy files only; --only judges each file by its own group's tests; the
    default run is the core group as before."""
    assert not set(targets.POLICY_TARGETS) & set(targets.TARGETS)
    assert main(["--list", "--policies", "--sample", "1", "--seed", "0"]) == 0
    listed = [line.split(":")[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(targets.POLICY_TARGETS)
    assert main(["--list", "--sample", "1", "--seed", "0"]) == 0
    assert [line.split(":")[0] for line in capsys.readouterr().out.splitlines()] == list(targets.TARGETS)
    assert _groups(_arguments([])) == [(list(targets.TARGETS), targets.TESTS)]
    assert _groups(_arguments(["--policies"])) == [(list(targets.POLICY_TARGETS), targets.POLICY_TESTS)]
    both = _groups(_arguments(["--only", "reference/lpm_scheduler.py", "--only", "reference/scheduler.py"]))
    picked = [([f for f in files if f in ("reference/lpm_scheduler.py", "reference/scheduler.py")], tests)
              for files, tests in both]
    assert picked == [(["reference/scheduler.py"], targets.TESTS),
                      (["reference/lpm_scheduler.py"], targets.POLICY_TESTS)]
    assert main(["--list", "--only", "reference/lpm_scheduler.py", "--sample", "2"]) == 0
    assert all(line.startswith("reference/lpm_scheduler.py:") for line in capsys.readouterr().out.splitlines())
    with pytest.raises(SystemExit):
        _arguments(["--policies", "--killer", "check"])
