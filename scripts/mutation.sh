#!/usr/bin/env bash
# Mutation testing of reference/ and the optimized scheduler core against the scheduler tests (spec/mutation.md):
# `bash scripts/mutation.sh [--sample N] [--seed S] [--jobs J] [--only FILE]...`. Prints each mutant's outcome,
# the score per file and overall, and every surviving mutant (file:line, the edit); exit 1 below 95% killed.
# The files and tests are listed in tests/mutation/targets.py. Works in mutants/ (git-ignored), never in the tree.
set -euo pipefail
cd "$(dirname "$0")/.."
# The python with the test extra: $PYTHON, else the active virtualenv's, else .venv/'s (scripts/setup.sh), else python3.
python=${PYTHON:-}
if [[ -z $python && -n ${VIRTUAL_ENV:-} ]]; then python=$VIRTUAL_ENV/bin/python; fi
if [[ -z $python && -x .venv/bin/python ]]; then python=.venv/bin/python; fi
python=${python:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m tests.mutation "$@"
