"""The scheduler core: lesson 03's decisions on faster machinery, pure Python and numpy (no torch).

Invariant: every decision made here (who runs, how many tokens, which blocks, who is
preempted, who finishes, what enters the prefix cache) is the reference scheduler's
(spec/optimized-scheduler.md). The room holds the scheduler and what only it uses:

* scheduler.py: ``Scheduler`` (add, schedule -> ``ScheduleOutput``, postprocess -> finished, abort);
* sequence.py: ``Sequence`` (the reference's attributes) over its ``CoreState`` record;
* decode_group.py: the decode batch kept from step to step, advanced by a clock;
* kv_cache_manager.py: the prefix cache (typed registration log, chain hashes) over
  block_pool.py (free queue and reference counts, on free_queue.py) and walk_memo.py;
* token_arena.py: every live sequence's tokens in one int64 array;
* errors.py: the typed errors and the one strict-int check.

The integer rules it shares with the invariant checks live in ``invariants.block_math``,
which imports nothing from ``optimized``.
"""
