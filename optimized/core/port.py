"""The scheduler port (ARCH-4): one protocol that every consumer of a scheduler drives, whichever it holds.

Invariant: a consumer (check mode, conformance replay, the trace's replay and
checks, the hypothesis machines) learns everything about a step from the port:
``schedule()`` returns a typed ``ScheduleOutput`` (who runs, prefill or decode,
who was preempted, prefix-cache hits) or raises the one ``EmptyDecodeError``;
``postprocess`` returns who finished, in batch order; ``blocks`` reads one
KV-cache block at a time; ``snapshot`` copies the whole state for the
invariants, and ``policy_state`` only the policy's own fields of it (a
priority per request, lpm's counts of passes), without a copy of the blocks.
So no consumer branches on the implementation, compares statuses, or reads a
scheduler's internals. The optimized scheduler satisfies it
directly; the reference goes through a thin adapter
(``optimized.verify.reference_port``), so the lesson's code keeps its own
signatures. A scheduling policy plugs in here, as one more implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from collections.abc import Sequence as Ordered
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, Protocol, TypeVar

from invariants.state import SchedulerState
from optimized.core.config import SchedulerConfig
from optimized.core.errors import EmptyDecodeError

__all__ = ["BlockReader", "EmptyDecodeError", "PortFactory", "ScheduleOutput", "SchedulerPort", "SeqLike"]


class SeqLike(Protocol):
    """What a consumer reads of a sequence: the reference ``Sequence``'s attributes, which both implementations'
    sequences have. ``status`` is for display and for the invariants' views, never compared across
    implementations."""

    @property
    def seq_id(self) -> int: ...
    @property
    def status(self) -> Enum: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_completion_tokens(self) -> int: ...
    @property
    def completion_token_ids(self) -> list[int]: ...
    @property
    def num_cached_tokens(self) -> int: ...
    @property
    def num_scheduled_tokens(self) -> int: ...
    @property
    def block_table(self) -> list[int]: ...
    @property
    def is_prefill(self) -> bool: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def ignore_eos(self) -> bool: ...
    @property
    def temperature(self) -> float: ...
    def __len__(self) -> int: ...


S = TypeVar("S", bound=SeqLike)


@dataclass(slots=True)  # not frozen: a frozen dataclass costs about 0.5 us more to build, on every step
class ScheduleOutput(Generic[S]):
    """What one ``schedule()`` did (OPT-22): the batch to run, and what the caller would otherwise scan for.

    A report, read by the caller; no scheduler reads its fields back, so changing one changes no decision: the
    scheduler keeps its own record of the batch, and ``postprocess`` refuses a batch changed since (OPT-23).
    (The core notes which list it handed out: that list takes the decode group's fast path, a copy the slow one.)

    ``batch`` is handed back to ``postprocess`` as it is (or a copy, in order). ``preempted`` are the sequences
    this step sent back to waiting, in the order it preempted them; ``prefix_hit_tokens`` counts the tokens the
    sequences admitted this step took from the prefix cache, ``prefix_query_tokens`` the tokens they looked up
    there (all theirs: a preempted sequence's generated ones too). Unpacking gives the lesson's ``(batch, is_prefill)``
    pair.
    """

    batch: list[S]
    is_prefill: bool
    preempted: tuple[S, ...] = ()
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0

    def __iter__(self) -> Iterator[Any]:
        return iter((self.batch, self.is_prefill))  # a tuple's iterator: cheaper than a generator per step


class BlockReader(Protocol):
    """One KV-cache block at a time, each read O(1) (amortised): a check that reads only the blocks a step
    touches costs nothing in proportion to ``num_blocks``. ``block_hash`` is -1 and ``token_ids_of`` empty for a
    block that carries no hash; a free block's ``ref_count`` is 0. ``free_block_ids`` (the free queue, front
    first) and ``hash_to_block_id`` (the prefix table) are copies, for a check that compares whole states
    (CHECK-3) without a snapshot's per-block copies."""

    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free(self) -> int: ...
    @property
    def free_block_ids(self) -> list[int]: ...
    @property
    def hash_to_block_id(self) -> dict[int, int]: ...
    def is_used(self, block_id: int) -> bool: ...
    def ref_count(self, block_id: int) -> int: ...
    def block_hash(self, block_id: int) -> int: ...
    def token_ids_of(self, block_id: int) -> list[int]: ...


class SchedulerPort(Protocol[S]):
    """A scheduler as its consumers drive it.

    ``new_sequence`` makes a sequence this scheduler takes; ``add`` queues it with its stop set (OPT-24) and its
    ``priority`` (an int, lower first; only the ``priority`` policy orders by it, spec/policies.md), and
    refuses with a ValueError, changing nothing, a sequence added before, ``max_tokens`` below 1, a stop id
    that is not an int or a priority that is not an int;
    ``schedule`` raises ``EmptyDecodeError`` where the lesson's ``assert scheduled_seqs`` fires (EDGE-2), leaving
    the state the lesson leaves, and refuses with a RuntimeError, changing nothing, while the last batch awaits
    its postprocess or ``abort_step`` (OPT-27); ``postprocess`` takes that batch (the list or a copy, in order)
    once and returns the sequences it finished, in batch order, refusing anything else (OPT-23); ``abort``
    and ``abort_step`` are spec/abort.md's; ``waiting`` and ``running`` are read-only, front first;
    ``policy_state`` is the ``SchedulerState`` fields of the policy (``snapshot``'s, without the blocks).
    """

    @property
    def config(self) -> SchedulerConfig: ...
    @property
    def waiting(self) -> Ordered[S]: ...
    @property
    def running(self) -> Ordered[S]: ...
    @property
    def blocks(self) -> BlockReader: ...
    def new_sequence(self, token_ids: list[int], max_tokens: int, ignore_eos: bool = False,
                     temperature: float = 1.0) -> S: ...
    def is_finished(self) -> bool: ...
    def add(self, seq: S, stop_token_ids: Collection[int] = (), priority: int = 0) -> None: ...
    def schedule(self) -> ScheduleOutput[S]: ...
    def postprocess(self, seqs: list[S], token_ids: Any, is_prefill: bool) -> list[S]: ...
    def abort(self, seq: S) -> None: ...
    def abort_step(self, batch: list[S]) -> None: ...
    def snapshot(self) -> SchedulerState: ...
    def policy_state(self) -> dict[str, Any]: ...


# Builds a scheduler of one implementation from a config: what ``conformance.implementation(name)`` gives.
PortFactory = Callable[[SchedulerConfig], SchedulerPort[Any]]
