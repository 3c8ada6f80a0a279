"""A request as the optimized scheduler sees it: the reference's attributes, read from one core record.

Invariants: everything the scheduler core decides about a sequence lives in
its ``CoreState`` record (``seq.core``), which only the core's classes write
(the scheduler, the decode group, the KV-cache manager, the token arena);
``Sequence`` itself only reads it. Outside the decode group (``core.group is
None``) the record's ``ntok``, ``ncached``, ``nsched``, ``is_prefill`` are the
reference's ``num_tokens``, ``num_cached_tokens``, ``num_scheduled_tokens``
and ``is_prefill``. Inside it, every member advances by one token per decode
step, so those values are derived from the group's clock instead of being
written for each sequence each step: with ``d = clock - core.since`` decode
steps since the sequence joined, ``num_tokens = ntok + d``,
``num_cached_tokens = num_tokens - 1``, ``num_scheduled_tokens`` is 1 while the
group's batch is in flight and 0 otherwise, and ``is_prefill`` is False
(OPT-3). Tokens live in the scheduler's ``TokenArena`` from ``add`` until the
sequence finishes, and in ``core.own`` before and after. ``core.hashes[i]`` is
the prefix-cache chain hash of full block i, computed once (it depends only on
tokens that never change) and kept across preemptions (OPT-7).
``block_table`` is a plain list, shared with the block manager. Ids are unique
and increasing: arrival order is id order.
"""

from __future__ import annotations

import itertools
from enum import Enum, auto
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from invariants.block_math import blocks_for
from optimized.core.errors import is_strict_int, strict_int

if TYPE_CHECKING:
    from optimized.core.token_arena import TokenArena

I64 = npt.NDArray[np.int64]

_seq_ids = itertools.count()
_INT64 = np.dtype("<i8")


class SequenceStatus(Enum):
    """Where a sequence is: waiting, running, or finished (or aborted). The core's own: no consumer compares it
    with the reference's (a port says who finished, ARCH-4)."""

    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class SequenceParams(NamedTuple):
    """What a sequence reads of its sampling parameters (the engine's ``SamplingParams`` has the same fields)."""

    temperature: float
    max_tokens: int
    ignore_eos: bool


class GroupClock(Protocol):
    """What a sequence reads of the decode group it is a member of."""

    @property
    def now(self) -> int: ...
    @property
    def inflight(self) -> bool: ...


def token_array(token_ids: Any) -> I64:
    """The prompt as little-endian int64; ValueError naming the field when it is not a list of ints.

    An int64 array (what the engine hands over, its tokens validated at its boundary) is copied as it is.
    """
    if isinstance(token_ids, np.ndarray) and token_ids.dtype == _INT64 and token_ids.ndim == 1:
        return token_ids.astype("<i8", copy=True)
    try:
        values = list(token_ids)
    except TypeError:
        raise ValueError(f"token_ids must be a list of integers, got {token_ids!r}") from None
    if not set(map(type, values)) <= {int}:  # one C pass for the usual list of ints
        for t in values:
            if not (is_strict_int(t) or isinstance(t, np.integer)):
                raise ValueError(f"token_ids must hold integers, got {t!r}")
    try:
        return np.array(values, dtype="<i8")
    except OverflowError:
        raise ValueError("token_ids must fit in int64") from None


class CoreState:
    """The scheduler core's record of one sequence: its counters, its arena region, its group stay, its hashes.

    Fields are written by the core's classes only. ``stops``: the token ids that finish the sequence when
    drawn, beside EOS (OPT-24). ``segments``: (since, anchor, block table list) per stay in the decode group:
    at clock c >= since its length was anchor + c and its blocks were in that list (read back by a deferred
    fill, OPT-17). ``pieces[i]``: the bytes of full block i, beside ``hashes[i]``.
    """

    __slots__ = (
        "arena",
        "gord",
        "group",
        "hashes",
        "is_prefill",
        "max_tokens",
        "ncached",
        "nsched",
        "ntok",
        "own",
        "pieces",
        "region_capacity",
        "region_offset",
        "segments",
        "since",
        "status",
        "stops",
    )

    def __init__(self, tokens: I64, max_tokens: int) -> None:
        self.status = SequenceStatus.WAITING
        self.ntok = int(tokens.shape[0])
        self.ncached = 0
        self.nsched = 0
        self.is_prefill = True
        self.max_tokens = max_tokens
        self.stops: frozenset[int] = frozenset()
        self.hashes: list[int] = []
        self.pieces: list[bytes] = []
        self.own: I64 | None = tokens
        self.arena: TokenArena | None = None
        self.region_offset = 0
        self.region_capacity = 0
        self.group: GroupClock | None = None
        self.since = 0
        self.gord = 0
        self.segments: list[tuple[int, int, list[int]]] = []

    def stored_length(self) -> int:
        """The number of tokens stored (the arena moves this many)."""
        g = self.group
        return self.ntok if g is None else self.ntok + g.now - self.since


class Sequence:
    __slots__ = (
        "block_size",
        "block_table",
        "core",
        "ignore_eos",
        "num_prompt_tokens",
        "seq_id",
        "temperature",
    )

    def __init__(self, token_ids: list[int] | I64, sampling_params: Any, block_size: int) -> None:
        strict_int(block_size, "block_size", 2)
        tokens = token_array(token_ids)
        self.seq_id = next(_seq_ids)
        self.block_size = block_size
        self.temperature: float = sampling_params.temperature
        self.ignore_eos: bool = sampling_params.ignore_eos
        self.num_prompt_tokens = int(tokens.shape[0])
        self.block_table: list[int] = []
        self.core = CoreState(tokens, sampling_params.max_tokens)

    # --- the reference's attributes -------------------------------------------------
    @property
    def status(self) -> SequenceStatus:
        return self.core.status

    @property
    def num_tokens(self) -> int:
        core = self.core
        g = core.group
        return core.ntok if g is None else core.ntok + g.now - core.since

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def num_cached_tokens(self) -> int:
        core = self.core
        g = core.group
        return core.ncached if g is None else core.ntok - 1 + g.now - core.since

    @property
    def num_scheduled_tokens(self) -> int:
        core = self.core
        g = core.group
        return core.nsched if g is None else int(g.inflight)

    @property
    def is_prefill(self) -> bool:
        core = self.core
        return core.is_prefill if core.group is None else False

    @property
    def max_tokens(self) -> int:
        return self.core.max_tokens

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_blocks(self) -> int:
        return blocks_for(self.num_tokens, self.block_size)

    def stored_tokens(self) -> I64:
        """A read-only view of the tokens (valid until the next step)."""
        core = self.core
        n = core.stored_length()
        if core.arena is not None:
            view = core.arena.data[core.region_offset : core.region_offset + n]
        else:
            assert core.own is not None
            view = core.own[:n]
        view = view.view()
        view.flags.writeable = False
        return view

    @property
    def token_ids(self) -> list[int]:
        """A fresh list (O(len)); decode reads ``last_token`` instead."""
        return self.stored_tokens().tolist()  # type: ignore[no-any-return]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.stored_tokens()[self.num_prompt_tokens :].tolist()  # type: ignore[no-any-return]

    @property
    def last_token(self) -> int:
        core = self.core
        n = core.stored_length()
        if n == 0:
            return -1
        if core.arena is not None:
            return int(core.arena.data[core.region_offset + n - 1])
        assert core.own is not None
        return int(core.own[n - 1])

    def block(self, i: int) -> list[int]:
        assert 0 <= i < self.num_blocks
        return self.stored_tokens()[i * self.block_size : (i + 1) * self.block_size].tolist()  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.core.status.name}, len={self.num_tokens}, "
            f"cached={self.num_cached_tokens}, blocks={self.block_table})"
        )
