"""One read-only view of a scheduler, whichever implementation made it.

Invariants never look inside a scheduler directly: they read a
``SchedulerState``. ``snapshot(scheduler)`` builds one, from the reference's
attributes, or by calling ``scheduler.snapshot()`` when an implementation keeps
its state in another shape (the optimized scheduler does). A snapshot is a deep
copy: later steps never change it, so a test can corrupt one freely.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class BlockView:
    block_id: int
    ref_count: int
    hash: int
    token_ids: list[int]


@dataclass
class SeqView:
    seq_id: int
    status: str  # "WAITING", "RUNNING" or "FINISHED"
    token_ids: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int
    num_scheduled_tokens: int
    block_table: list[int]
    max_tokens: int
    is_prefill: bool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerState:
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    blocks: list[BlockView]
    free_block_ids: list[int]
    used_block_ids: set[int]
    hash_to_block_id: dict[int, int]
    waiting: list[SeqView]
    running: list[SeqView]
    extra: dict[str, Any] = field(default_factory=dict)
    # The scheduling policy (spec/policies.md) and what its own clauses read: each live request's priority
    # (``priority``), how often each waiting one was passed over and the bound (``lpm``); empty otherwise.
    policy: str = "lesson"
    priorities: dict[int, int] = field(default_factory=dict)  # seq_id -> priority
    passes: dict[int, int] = field(default_factory=dict)  # seq_id -> times passed over
    patience: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


class Snapshotable(Protocol):
    def snapshot(self) -> SchedulerState: ...


def seq_view(seq: Any) -> SeqView:
    """A SeqView of any object with the reference Sequence's attributes."""
    return SeqView(
        seq_id=seq.seq_id,
        status=seq.status.name,
        token_ids=list(seq.token_ids),
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=seq.num_cached_tokens,
        num_scheduled_tokens=seq.num_scheduled_tokens,
        block_table=list(seq.block_table),
        max_tokens=seq.max_tokens,
        is_prefill=seq.is_prefill,
    )


def policy_fields(scheduler: Any, policy: str | None = None) -> dict[str, Any]:
    """The policy fields of a ``SchedulerState`` read off a bare reference scheduler, duck-typed (the invariants
    import no scheduler): a ``priority`` map makes it the ``priority`` policy, ``passes`` and ``patience`` the
    ``lpm`` one, else ``policy`` (the lesson's by default; ``mixed`` keeps no state of its own to tell it by)."""
    live = [*scheduler.waiting, *scheduler.running]
    priority = getattr(scheduler, "priority", None)
    if isinstance(priority, dict):
        return {"policy": policy or "priority", "priorities": {s.seq_id: priority[s.seq_id] for s in live}}
    passes, patience = getattr(scheduler, "passes", None), getattr(scheduler, "patience", None)
    if isinstance(passes, dict) and isinstance(patience, int):
        return {"policy": policy or "lpm", "patience": patience,
                "passes": {s.seq_id: passes[s.seq_id] for s in scheduler.waiting}}
    return {"policy": policy or "lesson"}


def snapshot(scheduler: Any, policy: str | None = None) -> SchedulerState:
    """A deep-copied state of a scheduler (reference attributes, or its own ``snapshot()``); ``policy`` names a
    bare reference's policy where its attributes do not tell it (``policy_fields``)."""
    own = getattr(scheduler, "snapshot", None)
    if callable(own):
        state: SchedulerState = own()
        return state
    bm = scheduler.block_manager
    return SchedulerState(
        block_size=scheduler.block_size,
        max_num_seqs=scheduler.max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        blocks=[BlockView(b.block_id, b.ref_count, b.hash, list(b.token_ids)) for b in bm.blocks],
        free_block_ids=list(bm.free_block_ids),
        used_block_ids=set(bm.used_block_ids),
        hash_to_block_id=dict(bm.hash_to_block_id),
        waiting=[seq_view(s) for s in scheduler.waiting],
        running=[seq_view(s) for s in scheduler.running],
        **policy_fields(scheduler, policy),
    )
