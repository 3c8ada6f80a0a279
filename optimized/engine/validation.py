"""Whether the engine can take a request: ``validate_request`` against the engine's fixed ``EngineLimits``.

Invariant: it changes nothing, and it refuses with a ValueError naming the limit
(ENG-9); a request it passes is never refused by the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from invariants.block_math import admits
from optimized.engine.sampling_params import SamplingParams, token_id


@dataclass(frozen=True)
class EngineLimits:
    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def eos(self) -> int:
        """The scheduler's own EOS (the first of the model's), -1 when it has none."""
        return self.eos_token_ids[0] if self.eos_token_ids else -1


def validate_request(token_ids: Seq[int], params: SamplingParams, limits: EngineLimits) -> list[int]:
    """The prompt as plain ints, or a ValueError naming the limit when the engine must refuse it (ENG-9).

    Changes nothing.
    """
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be optimized.SamplingParams, got {type(params).__name__}")
    # Re-running the dataclass validation catches a params object mutated after it was made.
    SamplingParams(**{f: getattr(params, f) for f in params.__dataclass_fields__})
    ids = [token_id(t) for t in token_ids]
    n = len(ids)
    if n == 0:
        raise ValueError("prompt must hold at least one token")
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, vocab_size={limits.vocab_size}), got {bad[0]!r}")
    # SamplingParams refused negative and non-integer stop ids when made; only the model knows the upper bound,
    # and an id past it can never be drawn, so the stop would silently never happen.
    unreachable = [t for t in params.stop_token_ids if t >= limits.vocab_size]
    if unreachable:
        raise ValueError(f"stop_token_ids must be in [0, vocab_size={limits.vocab_size}), got {unreachable[0]!r}")
    if n + params.max_tokens > limits.max_model_len:
        raise ValueError(
            f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len={limits.max_model_len}"
        )
    if not admits(n, params.max_tokens, limits.block_size, limits.num_blocks):
        raise ValueError(
            f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) can never fit the KV cache "
            f"(num_kvcache_blocks={limits.num_blocks} of kvcache_block_size={limits.block_size})"
        )
    return ids
