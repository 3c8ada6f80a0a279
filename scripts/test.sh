#!/usr/bin/env bash
# Sets up, then runs every check CI runs: ruff, mypy --strict, and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m ruff check .
python3 -m mypy
python3 -m pytest -q -p no:cacheprovider "$@"
