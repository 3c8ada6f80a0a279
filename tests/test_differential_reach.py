"""MUT-7: the differential machine's own strategies reach a walk-memo mutant that the ci run and old fuzzing missed.

The mutant (``False`` to ``True`` in ``WalkMemo.freed``) keeps a freed cache
hit marked as held; it shows only when a waiting request's remembered walk is
cut after one of its hits was freed, and the request is admitted on the stale
count. ``nanoverify fuzz --machine differential --minutes 2 --seed 1`` finds
it (spec/mutation.md); this test replays one fuzz chunk that finds it, without
shrinking, so that a change to the strategies that loses the reach fails here.
The chunk runs in a fresh interpreter: what hypothesis generates for a seed
also depends on the examples run before it in the same process. Without the
mutant the same machine finds nothing (tests/test_differential_machine.py and
the fuzz runs recorded in spec/mutation.md).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FINDING_CHUNK_SEED = 13  # chunk 12 of `fuzz --seed 1` (chunk c runs with seed 1 + c)

REPLAY = f"""
from optimized.cli.fuzz import run_chunk
from optimized.core.walk_memo import WalkMemo
from optimized.verify.machines import Stats
from optimized.verify.machines.differential_machine import DifferentialMachine


def freed_keeps_held(self, block_ids):
    # WalkMemo.freed with the mutant: held[index] = True where the code says False.
    if self.blocks.keys().isdisjoint(block_ids):
        return
    for block_id in block_ids:
        index = self.blocks.get(block_id, -1)
        if 0 <= index < self.cached and self.held[index]:
            self.held[index] = True
            self.used -= 1


WalkMemo.freed = freed_keeps_held
error = run_chunk(DifferentialMachine, Stats(), {FINDING_CHUNK_SEED}, shrink=False)
print("FOUND" if error is not None else "MISSED", str(error)[:300])
"""


@pytest.mark.clause("MUT-7")
def test_a_fuzz_chunk_finds_the_walk_memo_mutant() -> None:
    """MUT-7: the machine itself, under the fuzz profile, reports the mutant as an OPT-1 disagreement."""
    done = subprocess.run([sys.executable, "-c", REPLAY], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("FOUND") and "OPT-1" in done.stdout, done.stdout
