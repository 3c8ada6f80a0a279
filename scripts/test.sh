#!/usr/bin/env bash
# Sets up (scripts/setup.sh: the project's .venv/ unless a virtualenv is active), then runs every check CI runs
# in it: ruff, mypy --strict, import-linter's contracts (pyproject.toml: the floors of spec/architecture.md) and the
# test suite. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/venv.sh
venv_python=$(project_venv)
"$venv_python" -m ruff check .
"$venv_python" -m mypy
"$(dirname "$venv_python")/lint-imports" --no-cache
"$venv_python" -m pytest -q -p no:cacheprovider "$@"
