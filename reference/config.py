"""The scheduler's knobs, validated at the boundary.

Validation is the one thing here beyond the lesson: a bad value raises
ValueError naming the field before any scheduler state exists. block_size 1 is
refused because the lesson's ``len % block_size == 1`` test never fires then
(spec/known-edges.md, EDGE-1).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384
    eos: int = -1

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "eos"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        for name in ("num_blocks", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
