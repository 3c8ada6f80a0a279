"""The scheduling policies behind the scheduler port (ARCH-4, spec/policies.md): one factory, one class a policy.

Invariant: ``make_scheduler(config)`` is a scheduler of ``config.policy`` and of nothing else, and each class
decides every step as that policy's reference does (reference/ beside the lesson's scheduler; the differential
machine and conformance replay hold each to it). ``lesson`` is ``core.scheduler.Scheduler`` itself. A consumer
names a policy by the config it builds, never by a class.
"""

from __future__ import annotations

import importlib

from optimized.core.config import POLICIES, SchedulerConfig
from optimized.core.scheduler import Scheduler

__all__ = ["POLICIES", "make_scheduler"]

# policy -> (module, class): imported on first use, so the lesson's engine loads none of the others.
_CLASSES = {
    "lesson": ("optimized.core.scheduler", "Scheduler"),
    "mixed": ("optimized.core.mixed_scheduler", "MixedScheduler"),
    "priority": ("optimized.core.priority_scheduler", "PriorityScheduler"),
    "lpm": ("optimized.core.lpm_scheduler", "LpmScheduler"),
}
assert tuple(_CLASSES) == POLICIES


def scheduler_class(policy: str) -> type[Scheduler]:
    """The optimized class of ``policy`` (``Scheduler`` or a subclass); ValueError naming the policies for any
    other name."""
    if not isinstance(policy, str) or policy not in _CLASSES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    module, name = _CLASSES[policy]
    cls = getattr(importlib.import_module(module), name)
    assert isinstance(cls, type) and issubclass(cls, Scheduler)  # every policy's class is the core's, subclassed
    return cls


def make_scheduler(config: SchedulerConfig) -> Scheduler:
    """The optimized scheduler of ``config.policy``."""
    return scheduler_class(config.policy)(config)
