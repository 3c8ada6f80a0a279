"""Every spec clause is cited by a test marker, and every cited clause exists.

A clause is *defined* by its bold id (``**SCHED-4**``) in a chapter spec/*.md,
exactly once. It is *cited* only by a pytest marker naming it,
``@pytest.mark.clause("SCHED-4", "SCHED-5")``, applied to a test function or
class, set as a module's or class's ``pytestmark``, or given to
``pytest.param(..., marks=...)``. The markers are read statically from the AST
of tests/**/*.py. An id in a docstring or comment explains; it cites nothing.
A marker with no id, with an id that is not a string literal, or written where
pytest would not apply it is a problem, as is a marker citing an undefined
clause.
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEFINITION = re.compile(r"\*\*([A-Z]+-[0-9]+)\*\*")


def definitions(chapters: dict[str, str]) -> Counter[str]:
    """How many times each clause id is defined over the chapters."""
    return Counter(m for text in chapters.values() for m in DEFINITION.findall(text))


def _is_clause_marker(node: ast.expr) -> bool:
    """``pytest.mark.clause``, called or not."""
    target = node.func if isinstance(node, ast.Call) else node
    return (isinstance(target, ast.Attribute) and target.attr == "clause"
            and isinstance(target.value, ast.Attribute) and target.value.attr == "mark"
            and isinstance(target.value.value, ast.Name) and target.value.value.id == "pytest")


def _marks_in(node: ast.expr) -> Iterator[ast.expr]:
    """The marker expressions of a decorator, a ``pytestmark`` value or a ``marks=`` value (one or a list)."""
    yield from node.elts if isinstance(node, ast.List | ast.Tuple) else [node]


def _marks_of_body(body: list[ast.stmt]) -> Iterator[ast.expr]:
    """Decorators and ``pytestmark`` values of a module's or class's own definitions (nested classes included,
    not definitions inside functions: pytest never collects those)."""
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield from node.decorator_list
        if isinstance(node, ast.ClassDef):
            yield from _marks_of_body(node.body)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                  for t in node.targets):
            yield from _marks_in(node.value)


def _applied_marks(tree: ast.Module) -> Iterator[ast.expr]:
    """Every expression in a position where pytest applies it as a marker."""
    yield from _marks_of_body(tree.body)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "param":
            for keyword in node.keywords:
                if keyword.arg == "marks":
                    yield from _marks_in(keyword.value)


def marker_citations(name: str, source: str) -> tuple[set[str], list[str]]:
    """The clause ids the file's applied markers cite, and the problems of its clause markers."""
    tree = ast.parse(source, filename=name)
    applied = [m for m in _applied_marks(tree) if _is_clause_marker(m)]
    cited: set[str] = set()
    problems: list[str] = []
    for mark in applied:
        where = f"{name}:{mark.lineno}"
        args = mark.args if isinstance(mark, ast.Call) else []
        keywords = mark.keywords if isinstance(mark, ast.Call) else []
        if not args or keywords:
            problems.append(f"{where}: a clause marker names its clause ids, as strings, and nothing else")
        for arg in args:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                cited.add(arg.value)
            else:
                problems.append(f"{where}: a clause id is a string literal, not {ast.unparse(arg)}")
    placed = {id(m) for m in applied}
    problems += [f"{name}:{node.lineno}: a clause marker pytest does not apply (not a decorator, pytestmark or "
                 f"pytest.param marks)" for node in ast.walk(tree)
                 if isinstance(node, ast.Call) and _is_clause_marker(node) and id(node) not in placed]
    return cited, problems


def coverage_problems(chapters: dict[str, str], tests: dict[str, str]) -> list[str]:
    """What is wrong between the chapters' definitions and the tests' citations (markers only)."""
    defined = definitions(chapters)
    cited: dict[str, set[str]] = {}
    problems = [f"{c} is defined {n} times" for c, n in sorted(defined.items()) if n > 1]
    for name, source in sorted(tests.items()):
        ids, marker_problems = marker_citations(name, source)
        problems += marker_problems
        for clause in ids:
            cited.setdefault(clause, set()).add(name)
    problems += [f"{c} is cited by no test" for c in sorted(defined) if c not in cited]
    problems += [f"{c} is cited by {sorted(cited[c])} but defined by no chapter"
                 for c in sorted(cited) if c not in defined]
    return problems


def read_tree() -> tuple[dict[str, str], dict[str, str]]:
    chapters = {p.name: p.read_text(encoding="utf-8") for p in sorted((ROOT / "spec").glob("*.md"))}
    tests = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
             for p in sorted((ROOT / "tests").rglob("*.py"))}
    return chapters, tests


def test_every_clause_is_cited_and_every_citation_defined() -> None:
    chapters, tests = read_tree()
    assert definitions(chapters), "no clause found in spec/*.md"
    problems = coverage_problems(chapters, tests)
    assert not problems, "\n".join(problems)


def test_the_clause_marker_is_registered_and_markers_are_strict() -> None:
    """A misspelt marker (``pytest.mark.clauses``) must fail collection, not cite nothing in silence."""
    options = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"]
    assert "--strict-markers" in options["addopts"].split()
    assert any(line.startswith("clause(") for line in options["markers"])


CHAPTERS = {
    "a.md": "**AB-1** first. **AB-2** second, see AB-1. `AB-9` in code is no definition.",
    "b.md": "**CD-1** one, and **AB-2** again.",
}


def test_the_collector_finds_uncited_unknown_and_duplicate_clauses() -> None:
    tests = {"tests/test_x.py": 'import pytest\n\n\n@pytest.mark.clause("AB-1", "CD-1", "AB-3")\ndef test() -> None:\n'
                                '    """Encoding UTF-8."""\n'}
    assert definitions(CHAPTERS) == Counter({"AB-1": 1, "AB-2": 2, "CD-1": 1})
    assert coverage_problems(CHAPTERS, tests) == [
        "AB-2 is defined 2 times",
        "AB-2 is cited by no test",
        "AB-3 is cited by ['tests/test_x.py'] but defined by no chapter",
    ]


def test_a_mention_in_a_docstring_or_comment_alone_cites_nothing() -> None:
    """The old rule counted these; now only markers do, so every clause here is uncited."""
    source = '"""AB-1 in the module docstring."""\n# CD-1 in a comment\n\n\ndef test() -> None:\n    """AB-2."""\n'
    chapters = {"a.md": "**AB-1** **AB-2** **CD-1**"}
    assert coverage_problems(chapters, {"tests/test_x.py": source}) == [
        "AB-1 is cited by no test", "AB-2 is cited by no test", "CD-1 is cited by no test"]


@pytest.mark.parametrize("source", [
    'import pytest\n\n\n@pytest.mark.clause("AB-1")\nclass TestX:\n    @pytest.mark.clause("AB-2")\n'
    '    def test(self) -> None:\n        pass\n',
    'import pytest\n\npytestmark = [pytest.mark.usefixtures("env"), pytest.mark.clause("AB-1")]\n\n\n'
    'class TestX:\n    pytestmark = pytest.mark.clause("AB-2")\n',
    'import pytest\n\n\n@pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.clause("AB-1")),\n'
    '    pytest.param(2, marks=[pytest.mark.clause("AB-2")])])\ndef test(n: int) -> None:\n    pass\n',
])
def test_markers_cite_from_every_place_pytest_applies_them(source: str) -> None:
    assert marker_citations("t.py", source) == ({"AB-1", "AB-2"}, [])


@pytest.mark.parametrize(("source", "problem"), [
    ("@pytest.mark.clause()\ndef test(): pass", "t.py:1: a clause marker names its clause ids, as strings, and "
                                                "nothing else"),
    ("@pytest.mark.clause\ndef test(): pass", "t.py:1: a clause marker names its clause ids, as strings, and "
                                              "nothing else"),
    ('@pytest.mark.clause("AB-1", why="x")\ndef test(): pass', "t.py:1: a clause marker names its clause ids, as "
                                                               "strings, and nothing else"),
    ("@pytest.mark.clause(AB)\ndef test(): pass", "t.py:1: a clause id is a string literal, not AB"),
    ('@pytest.mark.clause("AB-1", 2)\ndef test(): pass', "t.py:1: a clause id is a string literal, not 2"),
    ('MARK = pytest.mark.clause("AB-1")', "t.py:1: a clause marker pytest does not apply (not a decorator, "
                                          "pytestmark or pytest.param marks)"),
    ('def test():\n    @pytest.mark.clause("AB-1")\n    def inner(): pass', "t.py:2: a clause marker pytest does "
                                                                          "not apply (not a decorator, pytestmark "
                                                                          "or pytest.param marks)"),
])
def test_a_malformed_or_unapplied_marker_is_a_problem(source: str, problem: str) -> None:
    assert problem in marker_citations("t.py", source)[1]


def test_a_fully_cited_spec_has_no_problem() -> None:
    chapters = {"a.md": "**AB-1** first. **AB-2** second."}
    tests = {"tests/test_x.py": "import pytest\n\n\n@pytest.mark.clause('AB-1', 'AB-2')\ndef test() -> None:\n"
                                "    pass\n"}
    assert coverage_problems(chapters, tests) == []


# Chapters whose clause ids were numbered as they grew, left to their owners to renumber (none now). Every other
# chapter, a new one included, must define its clauses in order.
OUT_OF_ORDER: set[str] = set()


def out_of_order(text: str) -> dict[str, list[int]]:
    """Each clause prefix whose ids, in the order the chapter defines them, are not 1, 2, ..., n."""
    seen: dict[str, list[int]] = {}
    for clause in DEFINITION.findall(text):
        prefix, number = clause.rsplit("-", 1)
        seen.setdefault(prefix, []).append(int(number))
    return {p: ids for p, ids in seen.items() if ids != list(range(1, len(ids) + 1))}


def test_clause_ids_read_in_order() -> None:
    """Every chapter but those of OUT_OF_ORDER defines its clauses in numeric order without gaps (a reader meets
    CKPT-2 after CKPT-1); out_of_order finds a swap and a gap."""
    assert out_of_order("**AB-1** **AB-3** **AB-2** **CD-1** **CD-3**") == {"AB": [1, 3, 2], "CD": [1, 3]}
    chapters = sorted((ROOT / "spec").glob("*.md"))
    assert {p.name for p in chapters} >= OUT_OF_ORDER
    for chapter in chapters:
        if chapter.name not in OUT_OF_ORDER:
            assert not out_of_order(chapter.read_text(encoding="utf-8")), chapter.name
