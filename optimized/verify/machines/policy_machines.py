"""The differential machine under each policy but the lesson's (POLICY-13): one subclass per policy.

Each runs the whole of ``DifferentialMachine`` with both schedulers built for its policy: under ``priority``
every request draws a priority (0-2, so ties and overtaking both happen), under ``lpm`` every run a patience
(0-4); the batch and state invariants are the policy's (``check_batch`` reads a ``mixed`` step as its decodes
then its prefills; ``check_state`` adds POLICY-2, 6, 10), and the state comparison covers priorities, passes
and patience.
"""

from __future__ import annotations

from optimized.verify.machines.differential_machine import DifferentialMachine


class MixedDifferential(DifferentialMachine):
    """OPT-1 under ``mixed``: decodes and prefills share a step (POLICY-2, POLICY-3)."""

    policy = "mixed"


class PriorityDifferential(DifferentialMachine):
    """OPT-1 under ``priority``: both queues in (priority, arrival) order (POLICY-6)."""

    policy = "priority"


class LpmDifferential(DifferentialMachine):
    """OPT-1 under ``lpm``: waiting by cached prefix, no request passed over more than patience times (POLICY-10)."""

    policy = "lpm"
