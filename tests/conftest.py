"""Hypothesis profiles for the suite: ``ci`` by default, ``fuzz`` with HYPOTHESIS_PROFILE=fuzz.

The settings themselves live in optimized.machines so that the installed
``nanoverify fuzz`` command uses exactly the same ones.
"""

from __future__ import annotations

import os

# Triton decides at its first import whether it interprets kernels, and transformers
# imports it too: without a GPU the kernel tests need the interpreter from the start.
if os.environ.get("NANOVERIFY_KERNEL_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings

from optimized.machines import CI_SETTINGS, FUZZ_SETTINGS

settings.register_profile("ci", **CI_SETTINGS)
settings.register_profile("fuzz", **FUZZ_SETTINGS)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
