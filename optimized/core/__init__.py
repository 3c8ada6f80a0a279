"""The scheduler core: lesson 03's decisions on faster machinery, pure Python and numpy (no torch).

Invariant: every decision made here (who runs, how many tokens, which blocks, who is
preempted, who finishes, what enters the prefix cache) is the reference scheduler's
(spec/optimized-scheduler.md). The room holds the scheduler and what only it uses: the
sequence, the decode group, the KV-cache manager and its free queue, the token arena and
the typed errors. The integer rules it shares with the invariant checks live in
``invariants.block_math``, which imports nothing from ``optimized``.
"""
