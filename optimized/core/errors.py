"""Typed errors of the engine and the optimized scheduler, and the checks that raise at a boundary.

Invariant: a refused value raises ``ValueError`` naming the field before anything changes; a count, a size or
an id is an ``int`` that is not a ``bool`` (Python's ``True`` is an int, never a count to us).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Collection
from typing import Any, TypeGuard

import numpy as np
import numpy.typing as npt

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


def refuse_a_second_schedule(awaiting: list[Any]) -> None:
    """RuntimeError while ``awaiting``, the last batch (empty when none), awaits its postprocess or abort_step:
    each schedule() is postprocessed once (OPT-27)."""
    if awaiting:
        raise RuntimeError("schedule: the last batch awaits its postprocess or abort_step (each schedule() "
                           "is postprocessed once)")


def is_step_batch(seqs: list[Any], awaiting: list[Any]) -> bool:
    """True when ``seqs`` holds ``awaiting``, the batch of the step that awaits its postprocess, as schedule()
    returned it (the same sequences, in its order: that list or a copy); False for an empty batch when no step
    awaits (the lesson's postprocess of nothing); else nothing changes: RuntimeError when no step awaits,
    ValueError for another list, which would hand tokens to sequences no step granted them to (OPT-23).

    ``awaiting`` is the scheduler's own record, a list the caller cannot reach. Sequences compare by identity
    (neither implementation's defines ``==``), so two lists compare in one C loop.
    """
    if not awaiting:
        if not seqs:
            return False
        raise RuntimeError("postprocess: no scheduled step awaits it (each schedule() is postprocessed once)")
    if len(seqs) != len(awaiting) or seqs != awaiting:  # a tuple is never equal to a list: refused too
        raise ValueError("postprocess: seqs must be the batch the last schedule() returned (that list or a copy "
                         "of it, in its order)")
    return True


def int64_tokens(token_ids: Any, count: int) -> npt.NDArray[np.int64]:
    """The first ``count`` tokens as int64, read before a postprocess changes anything; ValueError naming
    ``token_ids`` unless it is a list, a tuple or a one-dimensional array (numpy, or anything numpy reads as
    one, a CPU tensor) holding at least ``count`` integers within int64 (OPT-23). Both ports read their tokens
    here, so they take and refuse the same.

    ``struct`` reads a list of Python ints in one C loop, about a third of numpy's per-element cost; a signed
    integer array is cast whole. An item is an integer when it has ``__index__``, as ``struct`` reads it: tokens are
    the model's output, not a count, so a bool in a list reads as 0 or 1 (an array of bools is refused).
    """
    if type(token_ids) is not list and type(token_ids) is not tuple:
        token_ids = _one_dimensional(token_ids)
    if len(token_ids) < count:
        raise ValueError(f"postprocess: token_ids must hold a token for each of the batch's {count} sequences, "
                         f"got {len(token_ids)}")
    if isinstance(token_ids, np.ndarray) and token_ids.dtype.kind == "i":  # signed: within int64
        return token_ids[:count].astype(np.int64)
    if len(token_ids) != count:  # unsigned and object arrays are read one by one, as a list is
        token_ids = token_ids[:count]
    try:
        return np.frombuffer(_packer(count).pack(*token_ids), dtype=np.int64)
    except (struct.error, TypeError, ValueError, OverflowError):  # out of int64, or no integer
        bad = next((t for t in token_ids if not _storable(t)), None)
        raise ValueError(f"postprocess: token_ids must be int64 integers, got {bad!r}") from None


def _one_dimensional(token_ids: Any) -> npt.NDArray[Any]:
    try:
        array = np.asarray(token_ids)
    except (TypeError, ValueError, OverflowError, RuntimeError):
        raise ValueError(f"postprocess: token_ids must be a list or an array, got {type(token_ids).__name__}") \
            from None
    if array.ndim != 1 or array.dtype.kind not in "iuO":
        raise ValueError(f"postprocess: token_ids must be int64 integers in one dimension, got an array of "
                         f"{array.dtype} of shape {array.shape}")
    return array


def _storable(token: object) -> bool:
    try:
        _packer(1).pack(token)
    except (struct.error, TypeError, ValueError, OverflowError):
        return False
    return True


@functools.lru_cache(maxsize=64)
def _packer(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}q")
