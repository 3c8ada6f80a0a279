"""The block arithmetic's contracts, checked symbolically by crosshair, and its numpy form by hypothesis."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from invariants import block_math

ROOT = Path(__file__).resolve().parent.parent
# Seconds crosshair may spend on each pre/post pair before it accepts it (spec CONTRACT-7).
PER_CONDITION_TIMEOUT = "8"

MUTANTS = [
    "blocks_for_floor",
    "needs_new_block_off_by_one",
    "admits_forgets_last_token",
    "prefill_grant_chunks_everyone",
    "slot_of_swapped",
    "chunk_slot_runs_drops_tail",
]


def crosshair(target: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "crosshair", "check", "--per_condition_timeout", PER_CONDITION_TIMEOUT, target],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )


@pytest.mark.clause("CONTRACT-1", "CONTRACT-2", "CONTRACT-3", "CONTRACT-4", "CONTRACT-5", "CONTRACT-6", "CONTRACT-7")
def test_crosshair_finds_nothing_in_block_math() -> None:
    """CONTRACT-1, CONTRACT-2, CONTRACT-3, CONTRACT-4, CONTRACT-5, CONTRACT-6, CONTRACT-7.

    Every contract of invariants/block_math.py holds for all inputs crosshair explores.
    """
    result = crosshair("invariants/block_math.py")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


@pytest.mark.clause("CONTRACT-7")
def test_crosshair_catches_every_wrong_variant() -> None:
    """CONTRACT-7: each deliberately wrong variant violates its contract, and crosshair says where."""
    result = crosshair("tests/contract_mutants.py")
    assert result.returncode != 0
    caught = set(re.findall(r"when calling (\w+)\(", result.stdout))
    assert caught == set(MUTANTS), result.stdout


@pytest.mark.clause("CONTRACT-6")
@given(st.data())
def test_batch_slot_mapping_equals_per_token_definition(data: st.DataObject) -> None:
    """CONTRACT-6: the runner's numpy slot mapping equals slot_of applied token by token."""
    block_size = data.draw(st.integers(2, 8))
    rows = data.draw(st.integers(1, 5))
    width = data.draw(st.integers(1, 6))
    tables = np.full((rows, width), -1, dtype=np.int64)
    starts, ends, expected = [], [], []
    for r in range(rows):
        n_blocks = data.draw(st.integers(1, width))
        table = data.draw(st.lists(st.integers(0, 50), min_size=n_blocks, max_size=n_blocks, unique=True))
        tables[r, :n_blocks] = table
        end = data.draw(st.integers(0, n_blocks * block_size))
        start = data.draw(st.integers(0, end))
        starts.append(start)
        ends.append(end)
        expected += [block_math.slot_of(p, table, block_size) for p in range(start, end)]
        runs = block_math.chunk_slot_runs(table, start, end, block_size)
        assert block_math.expand_runs(runs) == block_math.per_token_slots(table, start, end, block_size)
    got = block_math.batch_slot_mapping(tables, np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64),
                                        block_size)
    assert got.tolist() == expected
