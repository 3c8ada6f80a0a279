"""Every spec clause is cited by a test, and every cited clause exists.

A clause is *defined* by its bold id (``**SCHED-4**``) in a chapter spec/*.md,
exactly once. It is *cited* when its id appears anywhere in a test file
tests/**/*.py (a docstring or a comment is enough). This file's own synthetic
ids are not citations, so it skips itself.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFINITION = re.compile(r"\*\*([A-Z]+-[0-9]+)\*\*")
CITATION = re.compile(r"\b([A-Z]+-[0-9]+)\b")
# Tokens of the clause shape that are not clauses.
NOT_CLAUSES = frozenset({"UTF-8", "UTF-16", "SHA-256", "GPT-2"})


def definitions(chapters: dict[str, str]) -> Counter[str]:
    """How many times each clause id is defined over the chapters."""
    return Counter(m for text in chapters.values() for m in DEFINITION.findall(text))


def citations(tests: dict[str, str]) -> dict[str, set[str]]:
    """Clause id -> the test files that mention it."""
    cited: dict[str, set[str]] = {}
    for name, text in tests.items():
        for clause in set(CITATION.findall(text)) - NOT_CLAUSES:
            cited.setdefault(clause, set()).add(name)
    return cited


def coverage_problems(chapters: dict[str, str], tests: dict[str, str]) -> list[str]:
    defined = definitions(chapters)
    cited = citations(tests)
    problems = [f"{c} is defined {n} times" for c, n in sorted(defined.items()) if n > 1]
    problems += [f"{c} is cited by no test" for c in sorted(defined) if c not in cited]
    problems += [f"{c} is cited by {sorted(cited[c])} but defined by no chapter"
                 for c in sorted(cited) if c not in defined]
    return problems


def read_tree() -> tuple[dict[str, str], dict[str, str]]:
    chapters = {p.name: p.read_text(encoding="utf-8") for p in sorted((ROOT / "spec").glob("*.md"))}
    tests = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
             for p in sorted((ROOT / "tests").rglob("*.py")) if p.resolve() != Path(__file__).resolve()}
    return chapters, tests


def test_every_clause_is_cited_and_every_citation_defined() -> None:
    chapters, tests = read_tree()
    assert definitions(chapters), "no clause found in spec/*.md"
    problems = coverage_problems(chapters, tests)
    assert not problems, "\n".join(problems)


def test_the_collector_finds_uncited_unknown_and_duplicate_clauses() -> None:
    chapters = {
        "a.md": "**AB-1** first. **AB-2** second, see AB-1. `AB-9` in code is no definition.",
        "b.md": "**CD-1** one, and **AB-2** again.",
    }
    tests = {
        "tests/test_x.py": '"""AB-1: checked."""\n# CD-1 too, and a typo: AB-3; encoding UTF-8',
    }
    assert definitions(chapters) == Counter({"AB-1": 1, "AB-2": 2, "CD-1": 1})
    assert coverage_problems(chapters, tests) == [
        "AB-2 is defined 2 times",
        "AB-2 is cited by no test",
        "AB-3 is cited by ['tests/test_x.py'] but defined by no chapter",
    ]


def test_a_fully_cited_spec_has_no_problem() -> None:
    chapters = {"a.md": "**AB-1** first. **AB-2** second."}
    tests = {"tests/test_x.py": "def test() -> None:\n    '''AB-1, AB-2'''"}
    assert coverage_problems(chapters, tests) == []
