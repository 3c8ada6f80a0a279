#!/usr/bin/env bash
# The device check (spec/gpu.md) on a CUDA machine that already has torch, triton, transformers and xxhash (and
# pytest and hypothesis, which the kernel rows' tests import) and no network: installs nanoverify itself at most
# (no dependencies, no build isolation, so nothing is downloaded), then runs `nanoverify gpu-check`, whose table is
# the last thing printed. Arguments go to gpu-check, e.g. `bash scripts/gpu_check.sh --tiny` for a short smoke run,
# `--keep` to keep checkpoints and logs.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import optimized.cli" >/dev/null 2>&1; then
  python3 -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . ||
    echo "gpu_check.sh: pip install -e failed; running from the source tree" >&2
fi
# The stages run as `python3 -m ...` from this folder, so the source tree is importable installed or not.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python3 -m optimized.cli gpu-check "$@"
