"""The house's rules a tool checks (spec/architecture.md): the floors (ARCH-1) and the read API (ARCH-5).

import-linter runs on the project itself, and on a skeleton of its rooms in a temporary folder with one import
planted, to see each contract of pyproject.toml refuse what it should.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
ROOMS = [room.strip() for layer in CONFIG["contracts"][0]["layers"] for room in layer.split("|")]


def lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"})


@pytest.mark.clause("ARCH-1")
def test_the_floors_hold_and_name_every_room() -> None:
    """ARCH-1: the project keeps every contract, and the layers contract names every room of optimized/ (a new
    room would otherwise be on no floor, and unchecked)."""
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "BROKEN" not in done.stdout and done.stdout.count("KEPT") == len(CONFIG["contracts"])
    rooms = {f"optimized.{p.name}" for p in (ROOT / "optimized").iterdir() if (p / "__init__.py").is_file()}
    assert rooms <= set(ROOMS), rooms - set(ROOMS)
    assert {"kernels", "invariants", "reference"} <= set(ROOMS)


def _skeleton(folder: Path, planted: tuple[str, str] | None) -> Path:
    """Every room as an empty package, plus one module importing a room below it; ``planted``: (room, import) adds
    a module to ``room`` with that import. The project's import-linter configuration beside them."""
    for room in ROOMS:
        package = folder / room.replace(".", "/")
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").write_text("")
    for parent in ("optimized",):
        (folder / parent / "__init__.py").write_text("")
    (folder / "optimized" / "cli" / "down.py").write_text("import optimized.entry\nimport kernels\nimport torch\n")
    if planted is not None:
        room, line = planted
        (folder / room.replace(".", "/") / "planted.py").write_text(line + "\n")
    lines = ["[tool.importlinter]", 'root_packages = ["kernels", "invariants", "reference", "optimized"]',
             "include_external_packages = true"]
    for contract in CONFIG["contracts"]:
        lines.append("[[tool.importlinter.contracts]]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in contract.items()]
    (folder / "pyproject.toml").write_text("\n".join(lines) + "\n")
    return folder


@pytest.mark.clause("ARCH-1")
@pytest.mark.parametrize(
    ("planted", "broken"),
    [
        (None, None),
        (("optimized.engine", "import optimized.parallel.group"), "optimized.engine is not allowed to import "
         "optimized.parallel"),
        (("optimized.benchmarks", "from optimized.cli import command"), "optimized.benchmarks is not allowed to "
         "import optimized.cli"),
        (("optimized.verify", "import optimized.parallel"), "optimized.verify is not allowed to import "
         "optimized.parallel"),
        (("kernels", "import optimized.core"), "kernels is not allowed to import optimized.core"),
        (("optimized.core", "from reference import config"), "optimized.core is not allowed to import reference"),
        (("reference", "import torch"), "reference is not allowed to import torch"),
        (("invariants", "import torch.nn"), "invariants is not allowed to import torch"),
    ],
)
def test_a_planted_import_breaks_its_contract(tmp_path: Path, planted: tuple[str, str] | None,
                                              broken: str | None) -> None:
    """ARCH-1: on a skeleton of the rooms, the project's contracts pass downward imports, and refuse an upward
    import, an import between rooms of one floor, core importing the oracle, and torch in reference/ or
    invariants/, naming the import."""
    done = lint_imports(_skeleton(tmp_path, planted))
    if broken is None:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    else:
        assert done.returncode != 0 and broken in " ".join(done.stdout.split()), done.stdout[-3000:]


# ARCH-5 ------------------------------------------------------------------------------------------------------------

def _is_llm(annotation: ast.expr | None) -> bool:
    return (isinstance(annotation, ast.Name) and annotation.id == "LLM") or (
        isinstance(annotation, ast.Constant) and annotation.value == "LLM")


def _makes_llm(value: ast.expr | None) -> bool:
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "LLM"


def llm_reads(source: str) -> list[tuple[int, str]]:
    """Every attribute ``source`` reads on an LLM: on a name bound to ``LLM(...)`` (assigned, or ``with ... as``),
    on a parameter annotated ``LLM``, or on ``self.X`` where X was assigned one of those."""
    tree = ast.parse(source)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and _is_llm(node.annotation):
            names.add(node.arg)
        elif isinstance(node, ast.Assign) and _makes_llm(node.value):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and (
                _is_llm(node.annotation) or _makes_llm(node.value)):
            names.add(node.target.id)
        elif isinstance(node, ast.withitem) and _makes_llm(node.context_expr) and isinstance(
                node.optional_vars, ast.Name):
            names.add(node.optional_vars.id)
    held = {target.attr for node in ast.walk(tree) if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Name) and node.value.id in names
            for target in node.targets if isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Name) and target.value.id == "self"}

    def is_llm(value: ast.expr) -> bool:
        return (isinstance(value, ast.Name) and value.id in names) or (
            isinstance(value, ast.Attribute) and value.attr in held and isinstance(value.value, ast.Name)
            and value.value.id == "self")

    return sorted((node.lineno, node.attr) for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and is_llm(node.value))


def past_the_api(source: str) -> list[str]:
    """The LLM attribute reads of ``source`` outside ``LLM.REQUEST_API`` and ``LLM.READ_API``."""
    from optimized.entry.llm import LLM

    allowed = set(LLM.REQUEST_API) | set(LLM.READ_API)
    return [f"line {line}: .{attr}" for line, attr in llm_reads(source) if attr not in allowed]


@pytest.mark.clause("ARCH-5")
def test_serve_cli_and_benchmarks_know_the_engine_only_through_the_read_api() -> None:
    """ARCH-5: every attribute that serve/, cli/ and benchmarks/ read on an LLM is in its declared request or read
    API (``LLM.REQUEST_API``, ``LLM.READ_API``), each of which exists, and ARCH-5 names every one of them. The
    check finds reads past the API however they are reached: a planted ``llm._lock``, ``self.llm.tokenizer``
    through an attribute, and the ``llm.engine.stats`` run.py once read."""
    from optimized.entry.llm import LLM

    planted = ("def f(llm: LLM) -> None:\n    with llm._lock:\n        llm.step()\n"
               "class Loop:\n    def __init__(self, llm: LLM) -> None:\n        self.llm = llm\n"
               "    def g(self) -> None:\n        self.llm.tokenizer.encode('x')\n        self.llm.stats\n"
               "one = LLM()\nst = one.engine.stats\nwith LLM() as many:\n    many._stepped.clear()\n")
    assert past_the_api(planted) == ["line 2: ._lock", "line 8: .tokenizer", "line 11: .engine",
                                     "line 13: ._stepped"]
    found = {str(path.relative_to(ROOT)): past_the_api(path.read_text(encoding="utf-8"))
             for room in ("serve", "cli", "benchmarks") for path in sorted((ROOT / "optimized" / room).glob("*.py"))}
    assert not {path: lines for path, lines in found.items() if lines}
    assert sum(len(llm_reads(path.read_text(encoding="utf-8"))) for room in ("serve", "cli", "benchmarks")
               for path in (ROOT / "optimized" / room).glob("*.py")) > 30  # the reads are found at all
    init = ast.unparse(ast.parse((ROOT / "optimized" / "entry" / "llm.py").read_text(encoding="utf-8")))
    for name in LLM.REQUEST_API + LLM.READ_API:
        assert hasattr(LLM, name) or f"self.{name} = " in init, name
    spec = (ROOT / "spec" / "architecture.md").read_text(encoding="utf-8")
    arch5 = spec[spec.index("**ARCH-5**"):spec.index("**ARCH-6**")]
    assert {name for name in LLM.REQUEST_API + LLM.READ_API if f"`{name}" not in arch5} == set()

