#!/usr/bin/env bash
# Mutation testing of reference/ and the optimized scheduler core against the scheduler tests (spec/mutation.md):
# `bash scripts/mutation.sh [--sample N] [--seed S] [--jobs J] [--only FILE]...`. Prints each mutant's outcome,
# the score per file and overall, and every surviving mutant (file:line, the edit); exit 1 below 95% killed.
# The files and tests are listed in tests/mutation/targets.py. Works in mutants/ (git-ignored), never in the tree.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [[ -x .venv/bin/python && -z ${PYTHON:-} ]]; then python=.venv/bin/python; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m tests.mutation "$@"
