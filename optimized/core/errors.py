"""Typed errors of the engine and the optimized scheduler, and the checks that raise at a boundary.

Invariant: a refused value raises ``ValueError`` naming the field before anything changes; a count, a size or
an id is an ``int`` that is not a ``bool`` (Python's ``True`` is an int, never a count to us).
"""

from __future__ import annotations

import operator
from collections.abc import Collection
from typing import Any, TypeGuard

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


class EmptyDecodeError(RuntimeError):
    """schedule() found nothing to run although sequences were waiting or running.

    The reference's ``assert scheduled_seqs`` fires at the same step (spec EDGE-2).
    """


class WorkloadError(ValueError):
    """A conformance workload is malformed; the message names the field."""


def is_strict_int(value: object) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def strict_int(value: object, name: str, minimum: int | None = None) -> int:
    """``value`` when it is a strict int at least ``minimum``; else a ValueError naming ``name`` and the bound."""
    if not is_strict_int(value) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{name} must be an integer{bound}, got {value!r}")
    return value


def stop_set(stop_token_ids: Collection[int]) -> frozenset[int]:
    """The stop ids as a set, each a strict int that an int64 token can equal; else a ValueError naming the field.

    A wider id could never be drawn, and numpy refuses to compare an int64 array with it (OPT-24).
    """
    stops = frozenset(stop_token_ids)
    if not all(is_strict_int(t) and INT64_MIN <= t <= INT64_MAX for t in stops):
        raise ValueError(f"stop_token_ids must be int64 integers, got {sorted(stops, key=repr)!r}")
    return stops


def require_step_batch(seqs: list[Any], batch: list[Any]) -> None:
    """ValueError unless ``seqs`` holds the awaiting step's batch, as schedule() returned it (the same sequences,
    in its order: that list or a copy), OPT-23. Another list would hand tokens to sequences no step granted them to.

    ``batch`` is the scheduler's own copy. Sequences compare by identity (neither implementation's defines
    ``==``), so two lists compare in one C loop.
    """
    if len(seqs) != len(batch) or seqs != batch:  # a tuple is never equal to a list: refused too
        raise ValueError("postprocess: seqs must be the batch the last schedule() returned (that list or a copy "
                         "of it, in its order)")


def require_int64_tokens(token_ids: Any, count: int) -> None:
    """ValueError unless the first ``count`` tokens are int64 integers (what the core stores them as), OPT-23."""
    try:
        readable = all(INT64_MIN <= operator.index(t) <= INT64_MAX for t in token_ids[:count])
    except TypeError:
        readable = False
    if not readable:
        raise ValueError(TOKENS_UNREADABLE)


TOKENS_UNREADABLE = "postprocess: token_ids must be int64 integers"
