"""What the mutation run mutates and which tests judge it: the one place to edit when files move.

The scheduler tests run fastest-first, so that ``pytest -x`` stops a killed
mutant early; test_contracts.py (a minute, engine contracts) and the engine
tests are left out: they add nothing to the scheduler's decisions.
"""

from __future__ import annotations

# Files whose code is mutated, relative to the repository root.
REFERENCE = (
    "reference/block_manager.py",
    "reference/config.py",
    "reference/extensions.py",
    "reference/scheduler.py",
    "reference/sequence.py",
)
OPTIMIZED_CORE = (
    "optimized/block_math.py",
    "optimized/decode_group.py",
    "optimized/errors.py",
    "optimized/free_queue.py",
    "optimized/kv_cache_manager.py",
    "optimized/scheduler.py",
    "optimized/sequence.py",
    "optimized/token_arena.py",
)
TARGETS = REFERENCE + OPTIMIZED_CORE

# The tests that judge every mutant, in the order pytest runs them.
TESTS = (
    "tests/test_mutation_gaps.py",
    "tests/test_lesson_exercises.py",
    "tests/test_block_manager_spec.py",
    "tests/test_abort.py",
    "tests/test_invariants.py",
    "tests/test_conformance.py",
    "tests/test_optimized_scheduler.py",
    "tests/test_reference_machine.py",
    "tests/test_differential_machine.py",
    "tests/test_empty_decode.py",
)

# Folders and files copied into the mutation workspace (what the tests import and read).
COPIED = ("reference", "optimized", "invariants", "kernels", "tests", "spec", "pyproject.toml")
