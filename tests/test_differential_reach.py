"""MUT-7: the differential machine's own strategies reach a walk-memo mutant that the ci run and old fuzzing missed.

The mutant (``False`` to ``True`` in ``WalkMemo.freed``) keeps a freed cache
hit marked as held; it shows only when a waiting request's remembered walk is
cut after one of its hits was freed, and the request is admitted on the stale
count. ``nanoverify fuzz --machine differential --minutes 2 --seed 1`` finds
it in its thirteenth chunk (chunk seed 13); this test replays that chunk without
shrinking, so a change to the strategies that loses the reach fails here.
"""

from __future__ import annotations

import hypothesis
import pytest

from optimized.commands.fuzz import run_chunk
from optimized.kv_cache_manager import WalkMemo
from optimized.machines import Stats
from optimized.machines.differential_machine import DifferentialMachine

FOUND_IN_CHUNK_SEED = 13  # `fuzz --seed 1` runs chunk c (from 0) with seed 1 + c


def _freed_keeps_held(self: WalkMemo, block_ids: list[int]) -> None:
    """WalkMemo.freed with the mutant: ``self.held[index] = True`` where the code says False."""
    if self.blocks.keys().isdisjoint(block_ids):
        return
    for block_id in block_ids:
        index = self.blocks.get(block_id, -1)
        if 0 <= index < self.cached and self.held[index]:
            self.held[index] = True
            self.used -= 1


def test_the_fuzz_chunk_finds_the_walk_memo_mutant(monkeypatch: pytest.MonkeyPatch) -> None:
    """MUT-7: the chunk of `fuzz --seed 1` that finds the mutant, replayed: a disagreement, found by the machine."""
    monkeypatch.setattr(WalkMemo, "freed", _freed_keeps_held)
    stats = Stats()
    error = run_chunk(DifferentialMachine, stats, FOUND_IN_CHUNK_SEED, shrink=False)
    assert error is not None and "OPT-1" in str(error), error


def test_the_same_chunk_passes_on_the_real_code() -> None:
    """MUT-7: without the mutant the chunk finds nothing (the finding is the mutant's, not the machine's)."""
    assert run_chunk(DifferentialMachine, Stats(), FOUND_IN_CHUNK_SEED, shrink=False) is None
    assert hypothesis.__version__  # the chunk's draws depend on hypothesis' version: the lock pins it
