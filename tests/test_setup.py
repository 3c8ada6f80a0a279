"""The setup installs exactly the pinned versions: every dependency pyproject.toml names is pinned in
requirements/lock.txt, and the environment running the suite holds the pins and nothing else (so CI tests what
the lock says)."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements" / "lock.txt"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    lines = [line.strip() for line in LOCK.read_text(encoding="utf-8").splitlines()]
    pairs = [line.split("==", 1) for line in lines if line and not line.startswith("#")]
    return {canonical(name): version for name, version in pairs}


def test_every_dependency_of_the_project_is_pinned() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    wanted = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    locked = pins()
    missing = [r.name for r in wanted if canonical(r.name) not in locked]
    assert not missing, f"not pinned in {LOCK.name}: {missing} (run bash scripts/lock.sh)"
    outside = [f"{r.name}=={locked[canonical(r.name)]}" for r in wanted
               if not r.specifier.contains(locked[canonical(r.name)], prereleases=True)]
    assert not outside, f"pins outside pyproject.toml's ranges: {outside}"


def test_the_environment_holds_exactly_the_pinned_versions() -> None:
    """Every pin is installed at its version, and nothing is installed that the lock does not pin (a dependency
    a release brings in must reach the lock too), but for pip and nanoverify itself."""
    installed = {canonical(d.metadata["Name"]): d.version for d in metadata.distributions()}
    locked = pins()
    drifted = [f"{name}: pinned {version}, installed {installed.get(name)}" for name, version in locked.items()
               if installed.get(name, "").split("+")[0] != version]
    assert not drifted, f"this environment differs from the lock (rerun bash scripts/setup.sh): {drifted}"
    unpinned = sorted(set(installed) - set(locked) - {"pip", "nanoverify"})
    assert not unpinned, f"installed but not pinned in {LOCK.name} (run bash scripts/lock.sh): {unpinned}"
