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

_ENGINE_INSIDES = {"engine", "shadow", "recorder", "_group"}  # what LLM holds beyond its read API


def reaches_through(source: str) -> list[str]:
    """The attribute reads of ``source`` that go past an LLM's read API (``x.engine``, ``x.shadow``, ...)."""
    return [f"line {node.lineno}: .{node.attr}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in _ENGINE_INSIDES]


@pytest.mark.clause("ARCH-5")
def test_cli_and_benchmarks_know_the_engine_only_through_the_read_api() -> None:
    """ARCH-5: no module of cli/ or benchmarks/ reads an LLM's engine, shadow, recorder or tensor-parallel group
    (the check itself finds `llm.engine.stats`, as run.py read it before)."""
    assert reaches_through("st = llm.engine.stats\nif llm.shadow is None: pass") == ["line 1: .engine",
                                                                                      "line 2: .shadow"]
    found = {str(path.relative_to(ROOT)): reaches_through(path.read_text(encoding="utf-8"))
             for room in ("cli", "benchmarks") for path in sorted((ROOT / "optimized" / room).glob("*.py"))}
    assert not {path: lines for path, lines in found.items() if lines}

