"""The scheduler core: lesson 03's decisions on faster machinery, pure Python and numpy (no torch).

Invariant: every decision made here (who runs, how many tokens, which blocks, who is
preempted, who finishes, what enters the prefix cache) is the reference scheduler's
(spec/optimized-scheduler.md). The room holds the scheduler, the port every consumer drives
a scheduler through, and what only the scheduler uses:

* port.py: ``SchedulerPort`` (ARCH-4), ``ScheduleOutput``, ``BlockReader``; the reference's adapter is
  optimized/verify/reference_port.py, so nothing here imports ``reference``;
* scheduler.py: ``Scheduler`` (add, schedule -> ``ScheduleOutput``, postprocess -> finished, abort), a port;
* config.py: ``SchedulerConfig``, validated when built (KNOB-4);
* sequence.py: ``Sequence`` (the reference's attributes) over its ``CoreState`` record, ``SequenceStatus``;
* decode_group.py: the decode batch kept from step to step, advanced by a clock;
* kv_cache_manager.py: the prefix cache (typed registration log, chain hashes) over
  block_pool.py (free queue and reference counts, on free_queue.py) and walk_memo.py;
* token_arena.py: every live sequence's tokens in one int64 array;
* errors.py: the typed errors and the one strict-int check.
* policies.py: ``make_scheduler``, the scheduler for a ``SchedulerConfig.policy`` (spec/policies.md), and the
  policies it builds: mixed_scheduler.py, priority_scheduler.py, lpm_scheduler.py (subclasses of ``Scheduler``).

The integer rules it shares with the invariant checks live in ``invariants.block_math``,
which imports nothing from ``optimized``.
"""
