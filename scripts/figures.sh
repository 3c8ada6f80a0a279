#!/usr/bin/env bash
# Regenerate spec/figures/: each figure's workload recorded through the reference (NAME.trace.jsonl) and drawn
# (NAME.png). tests/test_timeline.py checks the traces are what the current reference produces.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
PYTHONPATH="$PWD" "$PYTHON" -m optimized.trace.figures spec/figures
