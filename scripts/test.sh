#!/usr/bin/env bash
# Sets up (scripts/setup.sh: the project's .venv/ unless a virtualenv is active), then runs every check CI runs
# in it: ruff, mypy --strict, and the test suite. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/venv.sh
venv_python=$(project_venv)
"$venv_python" -m ruff check .
"$venv_python" -m mypy
"$venv_python" -m pytest -q -p no:cacheprovider "$@"
