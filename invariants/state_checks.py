"""Invariants of a scheduler's state, true between steps and right after schedule().

Each predicate inspects one aspect of a ``SchedulerState`` and returns the
violations it finds, each naming its INV- clause of spec/invariants.md. None of
them mutates the state or trusts it: a corrupt block id is reported, never
dereferenced blindly. ``between_steps`` is False only for a state taken right
after schedule(), when the batch's sequences carry their scheduled tokens.
"""

from __future__ import annotations

from collections import Counter

from invariants.block_math import blocks_for
from invariants.state import BlockView, SchedulerState, SeqView
from invariants.violation import Violation


def live_seqs(state: SchedulerState) -> list[SeqView]:
    return [*state.running, *state.waiting]


def holders(state: SchedulerState) -> Counter[int]:
    """How many block-table entries, over all live sequences, name each block id."""
    return Counter(b for seq in live_seqs(state) for b in seq.block_table)


def check_block_partition(state: SchedulerState) -> list[Violation]:
    """INV-1: free and used partition the block ids; the free queue has no duplicate."""
    found: list[Violation] = []
    all_ids = set(range(state.num_blocks))
    free = set(state.free_block_ids)
    if len(free) != len(state.free_block_ids):  # counted only when some block is there twice
        for block_id, n in sorted(Counter(state.free_block_ids).items()):
            if n > 1:
                found.append(Violation("INV-1", f"block {block_id} is {n} times in the free queue"))
    for block_id in sorted(free & state.used_block_ids):
        found.append(Violation("INV-1", f"block {block_id} is both free and used"))
    for block_id in sorted(all_ids - free - state.used_block_ids):
        found.append(Violation("INV-1", f"block {block_id} is neither free nor used"))
    for block_id in sorted((free | state.used_block_ids) - all_ids):
        found.append(Violation("INV-1", f"block id {block_id} does not exist ({state.num_blocks} blocks)"))
    for index, block in enumerate(state.blocks):
        if block.block_id != index:
            found.append(Violation("INV-1", f"blocks[{index}] carries block_id {block.block_id}"))
    return found


def check_ref_counts(state: SchedulerState) -> list[Violation]:
    """INV-2: ref_count is the number of block tables holding the block; free 0, used > 0."""
    found: list[Violation] = []
    held = holders(state)
    for seq in live_seqs(state):
        for block_id, n in Counter(seq.block_table).items():
            if n > 1:
                found.append(Violation("INV-2", f"seq {seq.seq_id} holds block {block_id} {n} times"))
            if not 0 <= block_id < state.num_blocks:
                found.append(Violation("INV-2", f"seq {seq.seq_id} holds nonexistent block {block_id}"))
    used_ids = state.used_block_ids
    for block in state.blocks:
        block_id, ref_count = block.block_id, block.ref_count
        used = block_id in used_ids
        if ref_count == held.get(block_id, 0) and (ref_count > 0 if used else ref_count == 0):
            continue  # what check_block_refs finds sound, decided without its call
        found += check_block_refs(block_id, held[block_id], used, ref_count)
    return found


def check_block_refs(block_id: int, tables: int, used: bool, ref_count: int) -> list[Violation]:
    """INV-2 for one existing block, held by ``tables`` block tables: a held block is used, its ref_count is
    ``tables``; a used block has ref_count > 0, a free one 0. What a check that reads only some blocks (the trace's
    replay, TRACE-5) calls for each."""
    found: list[Violation] = []
    if tables and not used:
        found.append(Violation("INV-2", f"block {block_id} is held by {tables} block tables but not used"))
    if ref_count != tables:
        found.append(Violation("INV-2", f"block {block_id} has ref_count {ref_count} but {tables} block tables "
                                        "hold it"))
    if used and ref_count <= 0:
        found.append(Violation("INV-2", f"used block {block_id} has ref_count {ref_count}"))
    if not used and ref_count != 0:
        found.append(Violation("INV-2", f"free block {block_id} has ref_count {ref_count}"))
    return found


def check_idle(state: SchedulerState) -> list[Violation]:
    """INV-3: with nothing waiting or running, no block is used."""
    if state.waiting or state.running or not state.used_block_ids:
        return []
    leaked = sorted(state.used_block_ids)
    return [Violation("INV-3", f"scheduler is idle but blocks {leaked} are still used")]


def check_fifo(state: SchedulerState) -> list[Violation]:
    """INV-6: under the lesson's policy, running then waiting is strictly increasing in seq_id (arrival order);
    the other policies reorder (spec/policies.md)."""
    if state.policy != "lesson":
        return []
    order = [seq.seq_id for seq in live_seqs(state)]
    if order != sorted(set(order)):
        return [Violation("INV-6", f"queue order running+waiting {order} is not arrival order")]
    return []


def check_prefix_table(state: SchedulerState) -> list[Violation]:
    """INV-5: each mapping h -> b names an existing, full block that carries hash h."""
    found: list[Violation] = []
    for h, block_id in state.hash_to_block_id.items():
        if not 0 <= block_id < state.num_blocks:
            found.append(Violation("INV-5", f"hash {h} maps to nonexistent block {block_id}"))
            continue
        block = state.blocks[block_id]
        if block.hash != h:
            found.append(Violation("INV-5", f"hash {h} maps to block {block_id}, which carries hash {block.hash}"))
        if len(block.token_ids) != state.block_size:
            found.append(Violation(
                "INV-5", f"hash {h} maps to block {block_id} holding {len(block.token_ids)} tokens, not a full block"
            ))
    return found


def check_token_counters(state: SchedulerState, between_steps: bool) -> list[Violation]:
    """INV-8: cached tokens lie within the sequence and its block table; nothing scheduled between steps."""
    found: list[Violation] = []
    for seq in live_seqs(state):
        cached, where = seq.num_cached_tokens, f"seq {seq.seq_id}"
        if not 0 <= cached <= seq.num_tokens:
            found.append(Violation("INV-8", f"{where} has {cached} cached tokens of {seq.num_tokens}"))
        if cached > len(seq.block_table) * state.block_size:
            found.append(Violation("INV-8", f"{where} has {cached} cached tokens but {len(seq.block_table)} blocks"))
        if not seq.block_table and (cached or seq.num_scheduled_tokens):
            found.append(Violation("INV-8", f"{where} holds no block but has {cached} cached / "
                                            f"{seq.num_scheduled_tokens} scheduled tokens"))
        if seq.num_scheduled_tokens < 0 or (between_steps and seq.num_scheduled_tokens != 0):
            found.append(Violation("INV-8", f"{where} has {seq.num_scheduled_tokens} scheduled tokens between steps"))
    return found


def check_queues(state: SchedulerState) -> list[Violation]:
    """INV-7: waiting holds WAITING prefill sequences, running holds RUNNING ones, none in both or twice."""
    found: list[Violation] = []
    for queue, status in ((state.waiting, "WAITING"), (state.running, "RUNNING")):
        for seq in queue:
            if seq.status != status:
                found.append(Violation("INV-7", f"seq {seq.seq_id} is in {status.lower()} with status {seq.status}"))
    for seq in state.waiting:
        if not seq.is_prefill:
            found.append(Violation("INV-7", f"waiting seq {seq.seq_id} has is_prefill False"))
    for seq_id, n in sorted(Counter(seq.seq_id for seq in live_seqs(state)).items()):
        if n > 1:
            found.append(Violation("INV-7", f"seq {seq_id} appears {n} times in waiting and running"))
    return found


def check_block_contents(state: SchedulerState) -> list[Violation]:
    """INV-4: a block carries no hash and no tokens, or a hash and exactly block_size tokens."""
    found: list[Violation] = []
    block_size = state.block_size
    for block in state.blocks:
        if len(block.token_ids) == (0 if block.hash == -1 else block_size):
            continue  # what check_block_content finds sound, decided without its call
        found += check_block_content(block, block_size)
    return found


def check_block_content(block: BlockView, block_size: int) -> list[Violation]:
    """INV-4 for one block (what a check that reads only some blocks calls for each)."""
    unhashed_empty = block.hash == -1 and not block.token_ids
    hashed_full = block.hash != -1 and len(block.token_ids) == block_size
    if unhashed_empty or hashed_full:
        return []
    return [Violation("INV-4", f"block {block.block_id} has hash {block.hash} and {len(block.token_ids)} tokens")]


def check_lengths(state: SchedulerState) -> list[Violation]:
    """INV-9: a live sequence keeps its prompt and has fewer completion tokens than max_tokens."""
    found: list[Violation] = []
    for seq in live_seqs(state):
        completion = seq.num_tokens - seq.num_prompt_tokens
        if not 0 <= completion < seq.max_tokens:
            found.append(Violation(
                "INV-9", f"seq {seq.seq_id} is live with {completion} completion tokens (max_tokens {seq.max_tokens})"
            ))
    return found


def check_running_tables(state: SchedulerState) -> list[Violation]:
    """INV-10: a running sequence's KV covers all but at most its last token, in exactly the blocks it needs."""
    found: list[Violation] = []
    for seq in state.running:
        computed = seq.num_cached_tokens + seq.num_scheduled_tokens
        if not seq.num_tokens - 1 <= computed <= seq.num_tokens:
            found.append(Violation(
                "INV-10", f"running seq {seq.seq_id} has {computed} cached+scheduled tokens of {seq.num_tokens}"
            ))
        need = blocks_for(computed, state.block_size)
        if len(seq.block_table) != need:
            found.append(Violation(
                "INV-10", f"running seq {seq.seq_id} has {len(seq.block_table)} blocks for {computed} "
                          f"cached+scheduled tokens, not {need}"
            ))
    return found


def check_waiting_tables(state: SchedulerState) -> list[Violation]:
    """INV-11: only waiting[0] may hold blocks: a prefill in progress, with every block of its tokens."""
    found: list[Violation] = []
    for index, seq in enumerate(state.waiting):
        if not seq.block_table:
            continue
        if index != 0:
            found.append(Violation("INV-11", f"waiting seq {seq.seq_id} at position {index} holds blocks"))
        need = blocks_for(seq.num_tokens, state.block_size)
        if len(seq.block_table) != need:
            found.append(Violation(
                "INV-11", f"waiting seq {seq.seq_id} has {len(seq.block_table)} blocks for {seq.num_tokens} tokens, "
                          f"not {need}"
            ))
        if seq.num_cached_tokens + seq.num_scheduled_tokens >= seq.num_tokens:
            found.append(Violation("INV-11", f"waiting seq {seq.seq_id} holding blocks has finished its prefill"))
    return found
