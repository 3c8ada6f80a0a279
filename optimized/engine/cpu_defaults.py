"""CPU settings that degrade gracefully when the machine is shared (spec ENG-31).

Invariants: unless ``NANOVERIFY_CPU_DEFAULTS=0``, importing ``optimized`` sets ``OMP_WAIT_POLICY=PASSIVE`` where the
user has not set it, so OpenMP threads sleep instead of spinning while they wait; and every ``LLM`` lowers torch's
thread count to the CPUs this process may use (its affinity mask and cgroup quota) when it is higher. A value the
user set (the variable, or ``torch.set_num_threads`` below that bound) is never changed. libgomp reads the variable
once, when torch loads it: a program that imports torch before ``optimized`` keeps libgomp's own policy.
This module does not import torch.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

SWITCH = "NANOVERIFY_CPU_DEFAULTS"
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0"


def set_wait_policy() -> None:
    """OMP_WAIT_POLICY=PASSIVE unless set, switched off, or too late (torch, and so libgomp, already loaded)."""
    if enabled() and "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def cgroup_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int | None:
    """The CPUs a cgroup v2 quota allows (``quota period`` in cpu.max, rounded up), None when unlimited or unknown."""
    try:
        quota, period = cpu_max.read_text(encoding="ascii").split()
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):  # no cgroup v2 file, "max" (no quota) or a format we do not know
        return None


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask, lowered by a cgroup quota."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpus()
    return cpus if quota is None else min(cpus, quota)


def cap_threads() -> None:
    """Lower torch's intra-op threads to ``usable_cpus()``; never raise them."""
    if not enabled():
        return
    import torch

    bound = usable_cpus()
    if torch.get_num_threads() > bound:
        torch.set_num_threads(bound)
