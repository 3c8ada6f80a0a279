#!/usr/bin/env bash
# Sets up (scripts/setup.sh: the project's .venv/ unless a virtualenv is active), then runs the main job in it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/venv.sh
venv_python=$(project_venv)
exec "$(dirname "$venv_python")/nanoverify" run "$@"
