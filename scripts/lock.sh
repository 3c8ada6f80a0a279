#!/usr/bin/env bash
# Refreshes requirements/lock.txt: the newest releases that pyproject.toml's ranges admit (torch stays the CPU
# wheel 2.13.0), installed into a throwaway virtualenv and frozen. Run the tests on the new lock before committing it.
set -euo pipefail
cd "$(dirname "$0")/.."
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# Made with the distribution's python3 where there is one, as CI runs: a newer interpreter would pin releases that
# refuse it (pymdown-extensions 13 needs Python 3.11.5; Debian 12's is 3.11.2).
python=${PYTHON:-python3}
if [[ -z "${PYTHON:-}" && -x /usr/bin/python3 ]]; then python=/usr/bin/python3; fi
"$python" -m venv "$scratch/venv"
"$scratch/venv/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0"
"$scratch/venv/bin/python" -m pip install -q --disable-pip-version-check -e ".[test,docs]"
{
  echo "# Every package the setup installs, at the version the suite passed with. Made by scripts/lock.sh."
  # torch without its local label (+cpu): pip still prefers the CPU wheel where one lies on disk, and the pin
  # stays installable from PyPI elsewhere.
  # --all: setuptools is torch's dependency and the build backend; pip itself is the venv's own.
  "$scratch/venv/bin/python" -m pip freeze --all --disable-pip-version-check --exclude-editable | grep -v '^pip==' |
    sed -E 's/^(torch==[^+]+)\+cpu$/\1/' | sort -f
} > requirements/lock.txt
echo "requirements/lock.txt: $(grep -vc '^#' requirements/lock.txt) packages"
