#!/usr/bin/env bash
# Sets up, then runs the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
nanoverify run
