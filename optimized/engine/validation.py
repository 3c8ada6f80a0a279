"""Whether the engine can take a request: the one validator (ENG-10, ARCH-6).

Invariant: it changes nothing, and it refuses with a ``RequestRefused`` (a
ValueError) carrying the field at fault and, for the context limits, OpenAI's
code ``context_length_exceeded``; a request it passes is never refused by the
scheduler. ``LLM`` and the server's HTTP side call them through one
composition (``entry.requests.validated_request``) with the engine's fixed
``EngineLimits``, so the two agree on every rule.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from invariants.block_math import admits
from optimized.core.errors import INT64_MAX, INT64_MIN
from optimized.engine.sampling_params import RequestRefused, SamplingParams, token_id

if TYPE_CHECKING:
    from optimized.models.tokenizer import Tokenizer

__all__ = ["EngineLimits", "RequestRefused", "prompt_ids", "validate_priority", "validate_request"]

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


@dataclass(frozen=True)
class EngineLimits:
    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    scheduling_policy: str = "lesson"  # only the ``priority`` policy takes a priority other than 0 (POLICY-12)

    @property
    def eos(self) -> int:
        """The scheduler's own EOS (the first of the model's), -1 when it has none."""
        return self.eos_token_ids[0] if self.eos_token_ids else -1

    def room(self, prompt_len: int) -> int:
        """The largest max_tokens a prompt of ``prompt_len`` tokens is admitted with, at least 1 (ENG-13:
        prompt + max_tokens - 1 tokens must fit the cache)."""
        cache = self.num_blocks * self.block_size + 1
        return max(1, min(self.max_model_len, cache) - prompt_len)


def prompt_ids(prompt: object, tokenizer: Tokenizer) -> list[int]:
    """ENG-10: a text prompt's token ids (it must be valid Unicode: a lone surrogate is not), or a token-id prompt
    as given (``validate_request`` checks its ids)."""
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestRefused("prompt", f"text is not valid Unicode: {e.reason} at index {e.start} "
                                 f"({prompt[e.start:e.end]!r})") from None
        try:
            return tokenizer.encode(prompt)
        except ValueError as e:  # a checkpoint without a tokenizer (ENG-14)
            raise RequestRefused("prompt", f"text cannot be encoded: {e}") from None
    if not isinstance(prompt, list):
        raise RequestRefused("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
    return prompt


def _past_limit(prompt_len: int, max_tokens: int, limits: EngineLimits) -> str | None:
    """Which limit a prompt of ``prompt_len`` tokens with ``max_tokens`` passes, in words; None when it fits."""
    if prompt_len + max_tokens > limits.max_model_len:
        return f"exceeds max_model_len={limits.max_model_len}"
    if not admits(prompt_len, max_tokens, limits.block_size, limits.num_blocks):
        return (f"can never fit the KV cache (num_kvcache_blocks={limits.num_blocks} of "
                f"kvcache_block_size={limits.block_size})")
    return None


def validate_request(token_ids: Seq[int], params: SamplingParams, limits: EngineLimits,
                     recheck: bool = True) -> list[int]:
    """The prompt as plain ints, or a ``RequestRefused`` when the engine must refuse it (ENG-10). Changes nothing.

    A request past a context limit names ``prompt`` when the prompt with one completion token cannot fit, else
    ``max_tokens``. ``recheck`` False: the caller made ``params`` just now (its values were checked then), so they
    are not checked again; a params object a user handed in may have been changed since it was made.
    """
    if not isinstance(params, SamplingParams):
        raise RequestRefused("sampling_params", f"must be optimized.SamplingParams, got {type(params).__name__}")
    if recheck:
        params.check()
    ids = [token_id(t) for t in token_ids]
    n = len(ids)
    if n == 0:
        raise RequestRefused("prompt", "must hold at least one token")
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestRefused("prompt", f"token ids must be in [0, vocab_size={limits.vocab_size}), got {bad[0]!r}")
    # SamplingParams refused negative and non-integer stop ids when made; only the model knows the upper bound,
    # and an id past it can never be drawn, so the stop would silently never happen.
    unreachable = [t for t in params.stop_token_ids if t >= limits.vocab_size]
    if unreachable:
        raise RequestRefused("stop_token_ids", f"must be in [0, vocab_size={limits.vocab_size}), "
                             f"got {unreachable[0]!r}")
    alone = _past_limit(n, 1, limits)
    if alone is not None:
        raise RequestRefused("prompt", f"is too long: {n} tokens + one completion token {alone}",
                             CONTEXT_LENGTH_EXCEEDED)
    past = _past_limit(n, params.max_tokens, limits)
    if past is not None:
        raise RequestRefused("max_tokens", f"is too large: {params.max_tokens} + {n} prompt tokens {past}",
                             CONTEXT_LENGTH_EXCEEDED)
    return ids


def validate_priority(priority: object, limits: EngineLimits) -> int:
    """POLICY-12: a request's priority as a plain int, or a ``RequestRefused`` naming ``priority``; changes nothing.

    Any integer type (a numpy integer too), never a bool, within int64 (as vLLM's and the trace's). Only the
    ``priority`` policy orders by it; under another a priority other than 0 would be silently ignored, so it is
    refused, as vLLM refuses it.
    """
    value = token_id(priority, "priority", "must be an int")
    if not INT64_MIN <= value <= INT64_MAX:
        raise RequestRefused("priority", f"must be an int64 (in [-2**63, 2**63 - 1]), got {value}")
    if value != 0 and limits.scheduling_policy != "priority":
        raise RequestRefused("priority", f"is {value}, but only scheduling_policy 'priority' orders requests by "
                             f"priority (this engine's is {limits.scheduling_policy!r}); leave it 0")
    return value
