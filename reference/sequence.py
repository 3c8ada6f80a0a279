"""A request as the scheduler sees it: its tokens, its progress, its blocks.

Invariants: ``num_tokens == len(token_ids)``; ``num_prompt_tokens <= num_tokens``;
``0 <= num_cached_tokens <= num_tokens``; ``num_scheduled_tokens`` is 0 between
steps; ``block_table`` is empty exactly when the sequence holds no KV blocks.
Block size is an argument, never a class attribute (the lesson's code keeps it
global; here every sequence carries the size it was created with).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import Enum, auto


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False


# Arrival order is id order (spec/block-manager.md).
_seq_ids = itertools.count()


class Sequence:
    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, block_size: int) -> None:
        self.seq_id = next(_seq_ids)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.last_token = self.token_ids[-1] if self.token_ids else -1
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.is_prefill = True
        self.block_table: list[int] = []
        self.block_size = block_size
        self.temperature = sampling_params.temperature
        self.max_tokens = sampling_params.max_tokens
        self.ignore_eos = sampling_params.ignore_eos

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    def block(self, i: int) -> list[int]:
        assert 0 <= i < self.num_blocks
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.name}, len={self.num_tokens}, "
            f"cached={self.num_cached_tokens}, blocks={self.block_table})"
        )
