"""Hypothesis profiles for the suite: ``ci`` by default, ``fuzz`` with HYPOTHESIS_PROFILE=fuzz.

The settings themselves live in optimized.machines so that the installed
``nanoverify fuzz`` command uses exactly the same ones.
"""

from __future__ import annotations

import os

from hypothesis import settings

from optimized.machines import CI_SETTINGS, FUZZ_SETTINGS

settings.register_profile("ci", **CI_SETTINGS)
settings.register_profile("fuzz", **FUZZ_SETTINGS)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
