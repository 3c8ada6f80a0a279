#!/usr/bin/env bash
# Builds the spec site (mkdocs.yml) into a scratch folder and renders one page in headless Chromium to a PNG, to see
# the figures as a reader does. Usage: bash scripts/docs_screenshot.sh [PAGE.html] [OUT.png]
# (default primer.html, docs-screenshot.png). Needs chromium or chromium-headless-shell (Debian: apt-get install
# chromium-headless-shell); nothing is fetched.
set -euo pipefail
cd "$(dirname "$0")/.."
page="${1:-primer.html}"
out="$(realpath -m "${2:-docs-screenshot.png}")"
browser=$(command -v chromium-headless-shell || command -v chromium || command -v chromium-browser || true)
[ -n "$browser" ] || { echo "docs_screenshot: no chromium on PATH (apt-get install chromium-headless-shell)" >&2; exit 2; }
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 "${PYTHON:-.venv/bin/python}" -m mkdocs build --strict --quiet --site-dir "$site"
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,7000 \
  --virtual-time-budget=5000 --screenshot="$out" "file://$site/$page" 2>/dev/null
echo "$out"
