"""Hypothesis state machines over the schedulers, the settings they run under, and their registry.

Each entry of ``MACHINES`` names a machine by ``module:class``, a
``RuleBasedStateMachine`` whose ``__init__`` takes an optional ``Stats``; the
machine adds to the ``Stats`` it was given and to nothing else, so a runner
that wants counters runs ``counting(Machine, stats)`` and pytest, which builds
``Machine()`` with no argument, simply gets a private one. The two
hypothesis profiles live here, not in tests/conftest.py, because the installed
``nanoverify fuzz`` command cannot import the test suite: ``ci`` keeps the whole
suite fast on two cores, ``fuzz`` runs long programs for as long as it is given.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields
from functools import partialmethod
from typing import Any, cast

from hypothesis.stateful import RuleBasedStateMachine

# In the order ``nanoverify fuzz`` takes them round-robin.
MACHINES: dict[str, str] = {
    "reference": "optimized.verify.machines.reference_machine:Machine",
    "differential": "optimized.verify.machines.differential_machine:Machine",
    "differential-mixed": "optimized.verify.machines.policy_machines:MixedDifferential",
    "differential-priority": "optimized.verify.machines.policy_machines:PriorityDifferential",
    "differential-lpm": "optimized.verify.machines.policy_machines:LpmDifferential",
}

# Settings as keyword arguments, so that conftest and the fuzz command build the
# same hypothesis.settings objects from one place.
CI_SETTINGS: dict[str, Any] = {"max_examples": 25, "stateful_step_count": 30, "deadline": None, "print_blob": True}
FUZZ_SETTINGS: dict[str, Any] = {
    "max_examples": 100_000,
    "stateful_step_count": 200,
    "deadline": None,
    "print_blob": True,
    # A fuzz run is reproduced from its seed or its blob, never from a saved database.
    "database": None,
}


@dataclass
class Stats:
    """What one or more machine runs did; the fuzz command prints these as its progress."""

    examples: int = 0
    rule_applications: int = 0
    steps: int = 0
    requests: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    aborts: int = 0  # requests aborted (spec/abort.md), failed steps' members included
    violations: int = 0

    def add(self, other: Stats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def counting(machine: type[RuleBasedStateMachine], stats: Stats) -> type[RuleBasedStateMachine]:
    """``machine`` as a class that hypothesis' runners can build with no argument, adding to ``stats``."""
    init = partialmethod(machine.__init__, stats=stats)
    return cast(type[RuleBasedStateMachine], type(machine.__name__, (machine,), {"__init__": init}))


def load(name: str) -> type[RuleBasedStateMachine]:
    """The machine registered as ``name``; ValueError naming the machines when there is no such machine."""
    if name not in MACHINES:
        raise ValueError(f"machine must be one of {sorted(MACHINES)}, got {name!r}")
    module, _, attribute = MACHINES[name].partition(":")
    machine: type[RuleBasedStateMachine] = getattr(importlib.import_module(module), attribute)
    return machine
