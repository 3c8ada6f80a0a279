"""The scheduler's knobs, validated when the config is built (KNOB-4).

Invariant: a ``SchedulerConfig`` that exists holds ints (never ``bool``),
``block_size >= 2`` (EDGE-1: the lesson's ``len % block_size == 1`` test never
fires at 1) and ``num_blocks``, ``max_num_seqs``, ``max_num_batched_tokens >= 1``,
``policy`` one of ``POLICIES`` and ``patience >= 0`` (spec/policies.md; only
``lpm`` reads it); a bad value raises ``ValueError`` naming the field before any
scheduler state exists. The core's own: the reference keeps its config for the lesson, so an
edit to the oracle never changes the engine (ARCH-1).
"""

from __future__ import annotations

from dataclasses import dataclass

from optimized.core.errors import strict_int

# Each knob's least value (None: any int): the one rule, read by the workload and trace readers too.
MINIMUMS = {"num_blocks": 1, "block_size": 2, "max_num_seqs": 1, "max_num_batched_tokens": 1, "eos": None}

# The scheduling policies (spec/policies.md): the lesson's first, the default.
POLICIES = ("lesson", "mixed", "priority", "lpm")
DEFAULT_PATIENCE = 8  # lpm: how often a waiting request may be passed over before it is due (POLICY-10)


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384
    eos: int = -1
    policy: str = "lesson"
    patience: int = DEFAULT_PATIENCE

    def __post_init__(self) -> None:
        for name, minimum in MINIMUMS.items():
            strict_int(getattr(self, name), name, minimum)
        if not isinstance(self.policy, str) or self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        strict_int(self.patience, "patience", 0)
