# Sourced by the scripts: project_venv prints the python of the virtualenv to use, making .venv/ if needed.
# The active virtualenv wins; otherwise .venv/ beside this folder, made with $PYTHON (default python3).
project_venv() {
  if [[ -n "${VIRTUAL_ENV:-}" ]]; then
    echo "$VIRTUAL_ENV/bin/python"
    return
  fi
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  if [[ ! -x "$root/.venv/bin/python" ]]; then
    local python=${PYTHON:-python3}
    if ! "$python" -m venv "$root/.venv" >&2; then
      rm -rf "$root/.venv"
      echo "setup: '$python -m venv' failed; on Debian/Ubuntu install the venv module (apt install python3-venv)," \
        "or activate a virtualenv of your own and run this again" >&2
      return 1
    fi
  fi
  echo "$root/.venv/bin/python"
}
