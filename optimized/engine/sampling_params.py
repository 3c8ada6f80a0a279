"""How a request wants its tokens drawn, validated when it is made.

A superset of the reference's ``SamplingParams`` (temperature, max_tokens,
ignore_eos), with the vLLM-style fields the engine honours. Every bad value
raises ``RequestRefused`` (a ValueError) naming the field, so a request that
reaches the scheduler is well-formed; the bounds that depend on the model (stop
ids below the vocabulary, the context length) are checked where the request
meets the model (``validation.validate_request``). The rules are the server's
too (ARCH-6): temperature in [0, 2] and at most 4 stop strings (OpenAI's
bounds), top_k 0 or -1 for off (vLLM's; 0 is stored as -1), ``logprobs`` and ``prompt_logprobs`` None or 0..20
(OpenAI's ``top_logprobs`` bound, vLLM's default ``max_logprobs``; ENG-18).
Integers (token ids, max_tokens, top_k, seed) may be of any integer type, a numpy
integer too, and are stored as plain ints; numbers (temperature, top_p) may be
any real type, a numpy float too, and are stored as floats; a bool is neither.
A temperature below ``GREEDY_BELOW`` (1e-5, vLLM's threshold too) means greedy:
dividing float32 logits by a tinier one overflows to inf. ``seed`` makes the draw
a pure function of (seed, position): the same tokens alone or batched, chunked or
preempted.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, SupportsIndex

GREEDY_BELOW = 1e-5
INT64_MAX = (1 << 63) - 1
MAX_TEMPERATURE = 2.0  # OpenAI's bound
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 4096  # SERVE-16: the stop strings' characters in all
MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound, vLLM's default max_logprobs (ENG-18)


class RequestRefused(ValueError):
    """ARCH-6: a request the engine will not take. ``field`` is the request field at fault (``prompt``,
    ``max_tokens``, ``temperature``...); ``reason`` says what is wrong with it without naming it (the server puts
    the body's name for the field before it); ``code`` is OpenAI's error code where it has one
    (``context_length_exceeded``), else None. Callers act on these, never on the message, which is
    ``message`` when given (a Python caller's own context) and else ``f"{field} {reason}"``."""

    def __init__(self, field: str, reason: str, code: str | None = None, message: str | None = None) -> None:
        super().__init__(f"{field} {reason}" if message is None else message)
        self.field = field
        self.reason = reason
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.field, self.reason, self.code, str(self))


def token_id(value: object, field: str = "prompt", what: str = "token ids must be ints") -> int:
    """ENG-10: a token id as a plain int; any integer type (a numpy integer too), never a bool, float or list."""
    if type(value) is int:
        return value
    as_int = _as_int(value)
    if as_int is None:
        raise RequestRefused(field, f"{what}, got {value!r} ({type(value).__name__})")
    return as_int


def _as_int(value: object) -> int | None:
    """``value`` as a plain int if it is an integer of any type (``operator.index``), never a bool; else None."""
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        return None
    try:
        return operator.index(value)
    except TypeError:  # an array of more than one element, a numpy bool
        return None


def _as_real(value: object) -> float | None:
    """``value`` if it is an int or a float, else as a float if it is a real number of another type (a numpy float);
    never a bool; else None."""
    if isinstance(value, bool):
        return None
    if type(value) is int or type(value) is float:
        return value
    return float(value) if isinstance(value, numbers.Real) else None


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
    logprobs: int | None = None  # ENG-18: each generated token's logprob and this many top alternatives
    prompt_logprobs: int | None = None  # ENG-18: the same for every prompt token but the first

    def __post_init__(self) -> None:
        for name, value in self._normalized().items():
            object.__setattr__(self, name, value)

    def check(self) -> None:
        """ENG-10: refuse (``RequestRefused``) a params object changed after it was made, as when it was made."""
        self._normalized()

    def _normalized(self) -> dict[str, Any]:
        """The fields in their stored form (plain ints and floats, ``top_k`` 0 as -1, tuples), each value checked
        first (``RequestRefused``)."""
        t = _as_real(self.temperature)
        if t is None:
            raise RequestRefused("temperature", f"must be a number, got {self.temperature!r}")
        if not 0 <= t <= MAX_TEMPERATURE:  # NaN too
            raise RequestRefused("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {t}")
        max_tokens = _as_int(self.max_tokens)
        if max_tokens is None or max_tokens < 1:
            raise RequestRefused("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise RequestRefused("ignore_eos", f"must be a bool, got {self.ignore_eos!r}")
        top_k = _as_int(self.top_k)
        if top_k is None or top_k < -1:
            raise RequestRefused("top_k", f"must be -1 or 0 (off) or a positive integer, got {self.top_k!r}")
        if top_k > INT64_MAX:
            raise RequestRefused("top_k", f"must be at most {INT64_MAX}, got {top_k}")
        top_p = _as_real(self.top_p)
        if top_p is None:
            raise RequestRefused("top_p", f"must be a number in (0, 1], got {self.top_p!r}")
        if not (0.0 < top_p <= 1.0):  # NaN too
            raise RequestRefused("top_p", f"must be in (0, 1], got {top_p}")
        seed = None if self.seed is None else _as_int(self.seed)
        if self.seed is not None and seed is None:
            raise RequestRefused("seed", f"must be an integer or None, got {self.seed!r}")
        return {"temperature": t, "max_tokens": max_tokens, "top_k": -1 if top_k == 0 else top_k, "top_p": top_p,
                "seed": seed, "stop_token_ids": _stop_ids(self.stop_token_ids), "stop": stop_strings(self.stop),
                "logprobs": _logprob_count("logprobs", self.logprobs),
                "prompt_logprobs": _logprob_count("prompt_logprobs", self.prompt_logprobs)}

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _logprob_count(name: str, value: object) -> int | None:
    """ENG-18: None (none asked) or how many top alternatives, 0..``MAX_LOGPROBS``, as a plain int."""
    if value is None:
        return None
    count = _as_int(value)
    if count is None or not 0 <= count <= MAX_LOGPROBS:
        raise RequestRefused(name, f"must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
    return count


@dataclass(frozen=True)
class Logprob:
    """ENG-18: a token's log probability under the model's raw distribution (``log_softmax`` of its logits, before
    temperature, top-k and top-p) and its rank there: 1 for the most likely token, ties ranked by token id."""

    logprob: float
    rank: int


def _stop_ids(value: object) -> tuple[int, ...]:
    if not isinstance(value, Iterable):
        raise RequestRefused("stop_token_ids", f"must be a sequence of token ids, got {value!r}")
    ids = tuple(token_id(t, "stop_token_ids", "must be ints") for t in value)
    for t in ids:
        if t < 0:
            raise RequestRefused("stop_token_ids", f"must hold non-negative integers, got {t!r}")
    return ids


def stop_strings(value: object) -> tuple[str, ...]:
    """SERVE-5: stop strings as a tuple of up to 4 non-empty UTF-8 strings, at most ``MAX_STOP_CHARS`` characters in
    all (SERVE-16); one string alone is a one-string tuple."""
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)):
        raise RequestRefused("stop", f"must be a string or a sequence of strings, got {type(value).__name__}")
    if len(value) > MAX_STOP_STRINGS:
        raise RequestRefused("stop", f"must hold at most {MAX_STOP_STRINGS} strings, got {len(value)}")
    for s in value:
        if not isinstance(s, str) or not s:
            raise RequestRefused("stop", f"must hold non-empty strings, got {s!r}")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestRefused("stop", f"strings must be valid Unicode, got {s!r}") from None
    total = sum(map(len, value))
    if total > MAX_STOP_CHARS:
        raise RequestRefused("stop", f"strings must total at most {MAX_STOP_CHARS} characters, got {total}")
    return tuple(value)
