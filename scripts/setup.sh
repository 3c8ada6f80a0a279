#!/usr/bin/env bash
# Installs nanoverify and what it needs into a virtualenv: the active one ($VIRTUAL_ENV), else the project's
# own, .venv/ or $NANOVERIFY_VENV (made here with $PYTHON, default python3, on first use). Nothing goes into the
# system's Python.
# Every package comes at the version in requirements/lock.txt (refresh: bash scripts/lock.sh); torch is the
# CPU wheel torch==2.13.0, installed first so nothing pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
venv_python=$(project_venv)
"$venv_python" -m pip install -q --disable-pip-version-check -c requirements/lock.txt torch setuptools
# No build isolation: the editable install is built by the pinned setuptools just installed, not the newest one.
"$venv_python" -m pip install -q --disable-pip-version-check --no-build-isolation -c requirements/lock.txt \
  -e ".[test,docs]"
