"""MUT-8: a program the differential machine's own strategies drew reaches a walk-memo mutant.

The mutant (``False`` to ``True`` in ``WalkMemo.freed``) keeps a freed cache
hit marked as held. ``nanoverify fuzz --machine differential --minutes 2
--seed 1 --no-shrink`` finds it in its first chunk (spec/mutation.md): the
machine's OPT-15 check sees the remembered walk differ from a fresh one. This
test replays the program that run found, from the ``@reproduce_failure`` blob
it printed, so that a change to the strategies (the blob no longer decodes to
that program) or a fix that no longer tells the mutant apart fails here and
the reach is measured again. The same program runs to its end on the
unmutated code. Each replay runs in a fresh interpreter.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Printed by the run above (hypothesis 6.170.17, the version the lock pins).
HYPOTHESIS = "6.170.17"
BLOB = ("AXicLY9REgIhDEMTFpZRZ/THcc9TD+l5fS0M0JYkpEXhOELRyU/ZssS12Q52qwiKagUhz/zVj9yoACblq5xaQnHwhtUFcxXqYli4l+dQ"
        "9R0m3Fyg1hiU1aXD3DnvMljWregzaQSOR3xWw91ijxvbH+FkF5DTOf824gRK4dQffdQbsQ==")

MUTANT = """
from optimized.core.walk_memo import WalkMemo


def freed_keeps_held(self, block_ids):
    # WalkMemo.freed with the mutant: held[index] = True where the code says False.
    if self.blocks.keys().isdisjoint(block_ids):
        return
    gone = set(block_ids)
    held, hits = self.held, self.hits
    for index in range(self.cached):
        if held[index] and hits[index] in gone:
            held[index] = True
            self.used -= 1


WalkMemo.freed = freed_keeps_held
"""

REPLAY = f"""
import hypothesis

from optimized.cli.fuzz import call, machine_test
from optimized.verify.machines import FUZZ_SETTINGS, Stats
from optimized.verify.machines.differential_machine import DifferentialMachine

test = machine_test(DifferentialMachine, Stats(), hypothesis.settings(**FUZZ_SETTINGS))
error = call(hypothesis.reproduce_failure({HYPOTHESIS!r}, {BLOB.encode()!r})(test))
print("RESULT:", type(error).__name__, str(error)[:300])  # NoneType when the program passed
"""


def _replay(with_mutant: bool) -> str:
    script = (MUTANT if with_mutant else "") + REPLAY
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.rpartition("RESULT: ")[2]  # hypothesis prints the program before it


@pytest.mark.clause("MUT-8")
def test_the_fuzzers_program_finds_the_walk_memo_mutant() -> None:
    """MUT-8: the machine, replaying its own finding, reports the mutant: the remembered walk is stale (OPT-15)."""
    out = _replay(with_mutant=True)
    assert out.startswith("Disagreement optimized after schedule: OPT-15: the walk remembered"), out


@pytest.mark.clause("MUT-8")
def test_the_same_program_passes_without_the_mutant() -> None:
    """MUT-8: on the unmutated code the program runs past the point where the mutant failed (no finding)."""
    out = _replay(with_mutant=False)
    assert out.startswith("DidNotReproduce"), out  # hypothesis: the program ran on past its failure
