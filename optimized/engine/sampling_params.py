"""How a request wants its tokens drawn, validated when it is made.

A superset of the reference's ``SamplingParams`` (temperature, max_tokens,
ignore_eos), with the vLLM-style fields the engine honours. Every bad value
raises ``RequestRefused`` (a ValueError) naming the field, so a request that
reaches the scheduler is well-formed; the bounds that depend on the model (stop
ids below the vocabulary, the context length) are checked where the request
meets the model (``validation.validate_request``). The rules are the server's
too (ARCH-6): temperature in [0, 2] and at most 4 stop strings (OpenAI's
bounds), top_k 0 or -1 for off (vLLM's; 0 is stored as -1).
Token ids (here the stop ids) are ints: any integer type, a numpy integer too, is
stored as a plain int; a bool, a float or a list is refused (``token_id``).
A temperature below ``GREEDY_BELOW`` (1e-5, vLLM's threshold too) means greedy:
dividing float32 logits by a tinier one overflows to inf. ``seed`` makes the draw
a pure function of (seed, position): the same tokens alone or batched, chunked or
preempted.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, SupportsIndex

GREEDY_BELOW = 1e-5
INT64_MAX = (1 << 63) - 1
MAX_TEMPERATURE = 2.0  # OpenAI's bound
MAX_STOP_STRINGS = 4  # OpenAI's limit


class RequestRefused(ValueError):
    """ARCH-6: a request the engine will not take. ``field`` is the request field at fault (``prompt``,
    ``max_tokens``, ``temperature``...); ``code`` is OpenAI's error code where it has one
    (``context_length_exceeded``), else None. Callers act on these two, never on the message."""

    def __init__(self, message: str, field: str, code: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.field, self.code)


def token_id(value: object, what: str = "prompt token ids", field: str = "prompt") -> int:
    """ENG-9: a token id as a plain int; any integer type (a numpy integer too), never a bool, float or list."""
    if type(value) is int:
        return value
    if isinstance(value, SupportsIndex) and not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:  # an array of more than one element, say
            pass
    raise RequestRefused(f"{what} must be ints, got {value!r} ({type(value).__name__})", field)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    top_k: int = -1  # -1 (or 0, stored as -1): off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings (SERVE-5); one str means (str,)

    def __post_init__(self) -> None:
        for name, value in self._normalized().items():
            object.__setattr__(self, name, value)

    def check(self) -> None:
        """ENG-9: refuse (``RequestRefused``) a params object changed after it was made, as when it was made."""
        self._normalized()

    def _normalized(self) -> dict[str, Any]:
        """The fields that are stored in a normal form, each value checked first (``RequestRefused``)."""
        t = self.temperature
        if not _number(t):
            raise RequestRefused(f"temperature must be a number, got {t!r}", "temperature")
        if not 0 <= t <= MAX_TEMPERATURE:  # NaN too
            raise RequestRefused(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {t}", "temperature")
        if not _integer(self.max_tokens) or self.max_tokens < 1:
            raise RequestRefused(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if not isinstance(self.ignore_eos, bool):
            raise RequestRefused(f"ignore_eos must be a bool, got {self.ignore_eos!r}", "ignore_eos")
        if not _integer(self.top_k) or self.top_k < -1:
            raise RequestRefused(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k!r}", "top_k")
        if self.top_k > INT64_MAX:
            raise RequestRefused(f"top_k must be at most {INT64_MAX}, got {self.top_k}", "top_k")
        if not _number(self.top_p):
            raise RequestRefused(f"top_p must be a number in (0, 1], got {self.top_p!r}", "top_p")
        if not (0.0 < self.top_p <= 1.0):  # NaN too
            raise RequestRefused(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.seed is not None and not _integer(self.seed):
            raise RequestRefused(f"seed must be an integer or None, got {self.seed!r}", "seed")
        return {"top_k": -1 if self.top_k == 0 else self.top_k, "stop_token_ids": _stop_ids(self.stop_token_ids),
                "stop": stop_strings(self.stop)}

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _stop_ids(value: object) -> tuple[int, ...]:
    if not isinstance(value, Iterable):
        raise RequestRefused(f"stop_token_ids must be a sequence of token ids, got {value!r}", "stop_token_ids")
    ids = tuple(token_id(t, "stop_token_ids", "stop_token_ids") for t in value)
    for t in ids:
        if t < 0:
            raise RequestRefused(f"stop_token_ids must hold non-negative integers, got {t!r}", "stop_token_ids")
    return ids


def stop_strings(value: object) -> tuple[str, ...]:
    """SERVE-5: stop strings as a tuple of up to 4 non-empty UTF-8 strings; one string alone is a one-string
    tuple."""
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)):
        raise RequestRefused(f"stop must be a string or a sequence of strings, got {type(value).__name__}", "stop")
    if len(value) > MAX_STOP_STRINGS:
        raise RequestRefused(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(value)}", "stop")
    for s in value:
        if not isinstance(s, str) or not s:
            raise RequestRefused(f"stop must hold non-empty strings, got {s!r}", "stop")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestRefused(f"stop strings must be valid Unicode, got {s!r}", "stop") from None
    return tuple(value)
