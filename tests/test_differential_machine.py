"""OPT-1, OPT-9: the differential machine, under the ``ci`` hypothesis profile.

The reference and the optimized scheduler receive the same requests, steps and
model tokens; every decision, every sequence and the block-manager state must
agree after each call, and both must satisfy every invariant.
"""

from __future__ import annotations

import pytest

from optimized.verify.machines.differential_machine import DifferentialMachine

pytestmark = pytest.mark.clause("OPT-1", "OPT-9")

TestDifferentialMachine = DifferentialMachine.TestCase
