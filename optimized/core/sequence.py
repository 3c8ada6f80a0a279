"""A request as the optimized scheduler sees it: the reference's attributes, stored so decode is O(1).

Invariants: outside the decode group (``_group is None``) the fields
``_ntok``, ``_ncached``, ``_nsched``, ``_is_prefill`` are the reference's
``num_tokens``, ``num_cached_tokens``, ``num_scheduled_tokens`` and
``is_prefill``. Inside it, every member advances by one token per decode step,
so those values are derived from the group's clock instead of being written for
each sequence each step: with ``d = clock - _since`` decode steps since the
sequence joined, ``num_tokens = _ntok + d``, ``num_cached_tokens = num_tokens -
1``, ``num_scheduled_tokens`` is 1 while the group's batch is in flight and 0
otherwise, and ``is_prefill`` is False (OPT-3). Tokens live in the scheduler's
``TokenArena`` from ``add`` until the sequence finishes, and in ``_own`` before
and after. ``_hashes[i]`` is the prefix-cache chain hash of full block i,
computed once (it depends only on tokens that never change) and kept across
preemptions (OPT-5). ``block_table`` is a plain list, shared with the block
manager. Ids are unique and increasing: arrival order is id order.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from invariants.block_math import blocks_for
from reference.sequence import SequenceStatus

if TYPE_CHECKING:
    from optimized.core.decode_group import DecodeGroup
    from optimized.core.token_arena import TokenArena

I64 = npt.NDArray[np.int64]

_seq_ids = itertools.count()


def token_array(token_ids: Any) -> I64:
    """The prompt as little-endian int64; ValueError naming the field when it is not a list of ints."""
    try:
        values = list(token_ids)
    except TypeError:
        raise ValueError(f"token_ids must be a list of integers, got {token_ids!r}") from None
    for t in values:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"token_ids must hold integers, got {t!r}")
    try:
        return np.array(values, dtype="<i8")
    except OverflowError:
        raise ValueError("token_ids must fit in int64") from None


class Sequence:
    __slots__ = (
        "_arena",
        "_gord",
        "_group",
        "_hashes",
        "_is_prefill",
        "_max_tokens",
        "_ncached",
        "_nsched",
        "_ntok",
        "_own",
        "_pieces",
        "_segments",
        "_since",
        "_status",
        "block_size",
        "block_table",
        "ignore_eos",
        "num_prompt_tokens",
        "region_capacity",
        "region_offset",
        "sampling_params",
        "seq_id",
        "temperature",
    )

    def __init__(self, token_ids: list[int], sampling_params: Any, block_size: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
            raise ValueError(f"block_size must be an integer >= 2, got {block_size!r}")
        tokens = token_array(token_ids)
        self.seq_id = next(_seq_ids)
        self.sampling_params = sampling_params
        self.block_size = block_size
        self.temperature: float = sampling_params.temperature
        self._max_tokens: int = sampling_params.max_tokens
        self.ignore_eos: bool = sampling_params.ignore_eos
        self.num_prompt_tokens = int(tokens.shape[0])
        self.block_table: list[int] = []
        self._status = SequenceStatus.WAITING
        self._ntok = self.num_prompt_tokens
        self._ncached = 0
        self._nsched = 0
        self._is_prefill = True
        self._hashes: list[int] = []
        self._pieces: list[bytes] = []  # the bytes of full block i, beside _hashes[i]
        self._own: I64 | None = tokens
        self._arena: TokenArena | None = None
        self.region_offset = 0
        self.region_capacity = 0
        self._group: DecodeGroup | None = None
        self._since = 0
        self._gord = 0
        # (since, anchor, block table list) per stay in the decode group: at clock c >= since its
        # length was anchor + c and its blocks were in that list (read back by a deferred fill).
        self._segments: list[tuple[int, int, list[int]]] = []

    # --- the reference's attributes -------------------------------------------------
    @property
    def status(self) -> SequenceStatus:
        return self._status

    @property
    def num_tokens(self) -> int:
        g = self._group
        return self._ntok if g is None else self._ntok + g.now - self._since

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def num_cached_tokens(self) -> int:
        g = self._group
        return self._ncached if g is None else self._ntok - 1 + g.now - self._since

    @property
    def num_scheduled_tokens(self) -> int:
        g = self._group
        return self._nsched if g is None else int(g.inflight)

    @property
    def is_prefill(self) -> bool:
        return self._is_prefill if self._group is None else False

    @property
    def max_tokens(self) -> int:
        return self._max_tokens

    @max_tokens.setter
    def max_tokens(self, value: int) -> None:
        """The engine cuts max_tokens at a stop token; a group member's finish step moves with it."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"max_tokens must be an integer, got {value!r}")
        if value <= self.num_completion_tokens:
            # The reference would never finish it by length (it tests ==): refuse at the boundary.
            raise ValueError(f"max_tokens must exceed the {self.num_completion_tokens} tokens already generated")
        arena = self._arena
        if arena is not None and self.num_prompt_tokens + value > self.region_capacity:
            arena.resize(self, self.num_prompt_tokens + value)
        g = self._group
        if g is None:
            self._max_tokens = value
        else:
            g.move_finish(self, value)

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_blocks(self) -> int:
        return blocks_for(self.num_tokens, self.block_size)

    def stored_tokens(self) -> I64:
        """A read-only view of the tokens (valid until the next step)."""
        n = self.num_tokens
        if self._arena is not None:
            view = self._arena.data[self.region_offset : self.region_offset + n]
        else:
            assert self._own is not None
            view = self._own[:n]
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
        n = self.num_tokens
        if n == 0:
            return -1
        if self._arena is not None:
            return int(self._arena.data[self.region_offset + n - 1])
        assert self._own is not None
        return int(self._own[n - 1])

    def block(self, i: int) -> list[int]:
        assert 0 <= i < self.num_blocks
        return self.stored_tokens()[i * self.block_size : (i + 1) * self.block_size].tolist()  # type: ignore[no-any-return]

    def stored_length(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self._status.name}, len={self.num_tokens}, "
            f"cached={self.num_cached_tokens}, blocks={self.block_table})"
        )
