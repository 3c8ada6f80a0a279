#!/usr/bin/env bash
# Installs nanoverify and what it needs. torch is pinned to the CPU wheel that
# lies on this kind of machine's disk, installed first so nothing pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check "torch==2.13.0"
python3 -m pip install -q --disable-pip-version-check -e ".[test]"
