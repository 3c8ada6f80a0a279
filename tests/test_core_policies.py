"""POLICY-11: ``optimized/core/policies.py`` builds the optimized class of the config's policy and of nothing else."""

from __future__ import annotations

from typing import Any

import pytest

from optimized.core.config import POLICIES, SchedulerConfig
from optimized.core.lpm_scheduler import LpmScheduler
from optimized.core.mixed_scheduler import MixedScheduler
from optimized.core.policies import make_scheduler, scheduler_class
from optimized.core.priority_scheduler import PriorityScheduler
from optimized.core.scheduler import Scheduler

pytestmark = pytest.mark.clause("POLICY-11")

CLASSES = {"lesson": Scheduler, "mixed": MixedScheduler, "priority": PriorityScheduler, "lpm": LpmScheduler}


@pytest.mark.parametrize("policy", POLICIES)
def test_each_policy_builds_its_own_class_and_names_itself(policy: str) -> None:
    """The class is the policy's exactly (not merely a Scheduler), and its snapshot names the policy."""
    assert scheduler_class(policy) is CLASSES[policy]
    scheduler = make_scheduler(SchedulerConfig(num_blocks=4, block_size=2, policy=policy))
    assert type(scheduler) is CLASSES[policy] and scheduler.snapshot().policy == policy


@pytest.mark.parametrize("policy", ["fifo", "", "Lesson", None, 3, ["lesson"]])
def test_any_other_name_is_a_value_error_naming_the_policies(policy: Any) -> None:
    """ValueError naming ``policy`` and the choices, whatever the value (an unhashable one too)."""
    with pytest.raises(ValueError, match="policy must be one of lesson, mixed, priority, lpm"):
        scheduler_class(policy)
