# Sourced by the scripts: project_venv prints the python of the virtualenv to use, making it if needed.
# The active virtualenv wins; otherwise $NANOVERIFY_VENV, or .venv/ beside this folder, made with $PYTHON
# (default python3), which must be Python 3.11 or newer (what requirements/lock.txt is made for).
project_venv() {
  if [[ -n "${VIRTUAL_ENV:-}" ]]; then
    echo "$VIRTUAL_ENV/bin/python"
    return
  fi
  local root venv
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  venv=${NANOVERIFY_VENV:-$root/.venv}
  if [[ ! -x "$venv/bin/python" ]]; then
    local python=${PYTHON:-python3}
    if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "setup: nanoverify needs Python 3.11 or newer; '$python' is" \
        "$("$python" --version 2>&1 || echo 'not found') (set PYTHON to another interpreter)" >&2
      return 1
    fi
    if ! "$python" -m venv "$venv" >&2; then
      rm -rf "$venv"
      echo "setup: '$python -m venv' failed; on Debian/Ubuntu install the venv module (apt install python3-venv)," \
        "or activate a virtualenv of your own and run this again" >&2
      return 1
    fi
  fi
  echo "$venv/bin/python"
}
