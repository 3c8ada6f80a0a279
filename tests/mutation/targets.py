"""What the mutation run mutates and which tests judge it: the one place to edit when files move.

The scheduler tests run fastest-first, so that ``pytest -x`` stops a killed
mutant early; test_contracts.py (a minute, engine contracts) and the engine
tests are left out: they add nothing to the scheduler's decisions. Two groups,
each its files and its judging tests: the lesson's scheduler and the core
(``TARGETS``, ``TESTS``: the default run), and the policies beside them
(``POLICY_TARGETS``, ``POLICY_TESTS``: ``--policies``, MUT-10). ``--only FILE``
judges a file with its own group's tests.
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
    "invariants/block_math.py",
    "optimized/core/block_pool.py",
    "optimized/core/config.py",
    "optimized/core/decode_group.py",
    "optimized/core/errors.py",
    "optimized/core/free_queue.py",
    "optimized/core/kv_cache_manager.py",
    "optimized/core/port.py",
    "optimized/core/scheduler.py",
    "optimized/core/sequence.py",
    "optimized/core/token_arena.py",
    "optimized/core/walk_memo.py",
)
TARGETS = REFERENCE + OPTIMIZED_CORE
# What ``--killer check`` mutates: the optimized core, not block_math (the invariants check mode runs read it).
CHECK_TARGETS = tuple(f for f in OPTIMIZED_CORE if f.startswith("optimized/core/"))

# The tests that judge every mutant, in the order pytest runs them.
TESTS = (
    "tests/test_mutation_gaps.py",
    "tests/test_lesson_exercises.py",
    "tests/test_block_manager_spec.py",
    "tests/test_abort.py",
    "tests/test_invariants.py",
    "tests/test_conformance.py",
    "tests/test_core_scheduler.py",
    "tests/test_core_port.py",
    "tests/test_core_decode_group.py",
    "tests/test_core_kv_cache_manager.py",
    "tests/test_core_free_queue.py",
    "tests/test_core_token_arena.py",
    "tests/test_core_sequence.py",
    "tests/test_core_abort.py",
    "tests/test_core_block_math.py",
    "tests/test_reference_machine.py",
    "tests/test_differential_machine.py",
    "tests/test_empty_decode.py",
)

# The scheduling policies (spec/policies.md): their references, their optimized classes and the factory.
POLICY_TARGETS = (
    "reference/mixed_scheduler.py",
    "reference/priority_scheduler.py",
    "reference/lpm_scheduler.py",
    "optimized/core/mixed_scheduler.py",
    "optimized/core/priority_scheduler.py",
    "optimized/core/lpm_scheduler.py",
    "optimized/core/policies.py",
)
# The tests that judge a policy mutant, fastest first.
POLICY_TESTS = (
    "tests/test_core_policies.py",
    "tests/test_mutation_policy_gaps.py",
    "tests/test_core_port.py",
    "tests/test_policy_references.py",
    "tests/test_conformance_policies.py",
    "tests/test_core_priority.py",
    "tests/test_core_lpm.py",
    "tests/test_core_mixed.py",
)
# Each group: its name, its files, the tests that judge them.
GROUPS = (("core", TARGETS, TESTS), ("policies", POLICY_TARGETS, POLICY_TESTS))

# Folders and files copied into the mutation workspace (what the tests import and read).
COPIED = ("reference", "optimized", "invariants", "kernels", "tests", "spec", "pyproject.toml")
