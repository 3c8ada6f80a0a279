"""Typed errors of the engine and the optimized scheduler, and the one strict-int check that raises at a boundary.

Invariant: a refused value raises ``ValueError`` naming the field before anything changes; a count, a size or
an id is an ``int`` that is not a ``bool`` (Python's ``True`` is an int, never a count to us).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TypeGuard

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
