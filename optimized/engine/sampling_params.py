"""How a request wants its tokens drawn, validated when it is made.

A superset of the reference's ``SamplingParams`` (temperature, max_tokens,
ignore_eos), with the vLLM-style fields the engine honours. Every bad value
raises ValueError naming the field, so a request that reaches the scheduler is
well-formed; the one model-dependent bound, stop ids below the vocabulary size,
is checked where the request meets the model (``engine.validate_request``).
Token ids (here the stop ids) are ints: any integer type, a numpy integer too, is
stored as a plain int; a bool, a float or a list is refused (``token_id``).
A temperature below ``GREEDY_BELOW`` (1e-5, vLLM's threshold too) means greedy:
dividing float32 logits by a tinier one overflows to inf. ``seed`` makes the draw
a pure function of (seed, position): the same tokens alone or batched, chunked or
preempted.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import SupportsIndex

GREEDY_BELOW = 1e-5
INT64_MAX = (1 << 63) - 1


def token_id(value: object, what: str = "prompt token ids") -> int:
    """ENG-9: a token id as a plain int; any integer type (a numpy integer too), never a bool, float or list."""
    if type(value) is int:
        return value
    if isinstance(value, SupportsIndex) and not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:  # an array of more than one element, say
            pass
    raise ValueError(f"{what} must be ints, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings (SERVE-5); one str means (str,)

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or (self.top_k != -1 and self.top_k < 1):
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if self.top_k > INT64_MAX:
            raise ValueError(f"top_k must be at most {INT64_MAX}, got {self.top_k}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        try:
            stops = tuple(self.stop_token_ids)
        except TypeError:
            raise ValueError(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}") from None
        stops = tuple(token_id(t, "stop_token_ids") for t in stops)
        for t in stops:
            if t < 0:
                raise ValueError(f"stop_token_ids must hold non-negative integers, got {t!r}")
        object.__setattr__(self, "stop_token_ids", stops)
        object.__setattr__(self, "stop", stop_strings(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def stop_strings(value: object) -> tuple[str, ...]:
    """SERVE-5: stop strings as a tuple of non-empty UTF-8 strings; one string alone is a one-string tuple."""
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"stop must be a string or a sequence of strings, got {type(value).__name__}")
    for s in value:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"stop strings must be valid Unicode, got {s!r}") from None
    return tuple(value)
