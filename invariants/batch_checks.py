"""Invariants of one batch, checked against the state taken right after schedule().

The batch is a list of ``SeqView``s in batch order; the state holds the same
sequences (they are still waiting or running right after schedule()). A batch
is all-prefill or all-decode; only its first sequence may be a partial prefill;
each sequence writes only blocks it alone holds, which carry no hash yet. Each
predicate returns the violations it finds, naming INV- clauses of
spec/invariants.md. Under ``priority`` a completed prefill takes its place in
``running`` (not its tail); a ``mixed`` step is its decodes then its prefills,
judged by ``check_mixed_batch`` (POLICY-2, POLICY-3).
"""

from __future__ import annotations

from invariants.block_math import blocks_for
from invariants.state import SchedulerState, SeqView
from invariants.state_checks import holders
from invariants.violation import Violation


def unfinished(seq: SeqView) -> bool:
    """True when this step's chunk leaves the sequence's prefill incomplete."""
    return seq.num_cached_tokens + seq.num_scheduled_tokens < seq.num_tokens


def check_limits(state: SchedulerState, batch: list[SeqView], is_prefill: bool) -> list[Violation]:
    """INV-12: at most max_num_seqs sequences; a prefill batch also at most max_num_batched_tokens tokens."""
    found: list[Violation] = []
    if len(batch) > state.max_num_seqs:
        found.append(Violation("INV-12", f"batch has {len(batch)} sequences, max_num_seqs is {state.max_num_seqs}"))
    tokens = sum(seq.num_scheduled_tokens for seq in batch)
    # The lesson's decode loop never consults the token budget: a decode batch is
    # bounded by max_num_seqs alone and may exceed max_num_batched_tokens.
    if is_prefill and tokens > state.max_num_batched_tokens:
        found.append(Violation(
            "INV-12", f"prefill batch has {tokens} tokens, max_num_batched_tokens is {state.max_num_batched_tokens}"
        ))
    return found


def check_chunking(state: SchedulerState, batch: list[SeqView], is_prefill: bool) -> list[Violation]:
    """INV-13: only the first sequence may be left unfinished, and then it is alone and fills the token budget."""
    found: list[Violation] = []
    if not is_prefill:
        return found
    for index, seq in enumerate(batch):
        if not unfinished(seq):
            continue
        if index != 0:
            found.append(Violation("INV-13", f"seq {seq.seq_id} at batch position {index} is a partial prefill"))
        elif len(batch) != 1:
            found.append(Violation("INV-13", f"partial prefill seq {seq.seq_id} shares its batch with others"))
        elif seq.num_scheduled_tokens != state.max_num_batched_tokens:
            found.append(Violation(
                "INV-13", f"partial prefill seq {seq.seq_id} got {seq.num_scheduled_tokens} tokens, "
                         f"not the whole budget {state.max_num_batched_tokens}"
            ))
    return found


def check_decode(batch: list[SeqView], is_prefill: bool) -> list[Violation]:
    """INV-14: a decode batch computes exactly one token per sequence, its last one."""
    found: list[Violation] = []
    if is_prefill:
        return found
    for seq in batch:
        if seq.num_scheduled_tokens != 1 or seq.num_cached_tokens != seq.num_tokens - 1:
            found.append(Violation(
                "INV-14", f"decode seq {seq.seq_id} schedules {seq.num_scheduled_tokens} tokens after "
                          f"{seq.num_cached_tokens} cached of {seq.num_tokens}"
            ))
    return found


def check_scheduled_counts(state: SchedulerState, batch: list[SeqView]) -> list[Violation]:
    """INV-15: every batch sequence gets at least one token; no other sequence gets any."""
    found: list[Violation] = []
    in_batch = {seq.seq_id for seq in batch}
    for seq in batch:
        if seq.num_scheduled_tokens < 1:
            found.append(Violation("INV-15", f"seq {seq.seq_id} is in the batch with no token to compute"))
    for seq in [*state.running, *state.waiting]:
        if seq.seq_id not in in_batch and seq.num_scheduled_tokens != 0:
            found.append(Violation(
                "INV-15", f"seq {seq.seq_id} is not in the batch but has {seq.num_scheduled_tokens} scheduled tokens"
            ))
    return found


def written_blocks(seq: SeqView, block_size: int) -> list[int]:
    """The block ids holding positions [num_cached_tokens, num_cached_tokens + num_scheduled_tokens)."""
    if seq.num_scheduled_tokens <= 0:
        return []
    first = seq.num_cached_tokens // block_size
    last = (seq.num_cached_tokens + seq.num_scheduled_tokens - 1) // block_size
    return seq.block_table[first : last + 1]


def check_exclusive_writes(state: SchedulerState, batch: list[SeqView]) -> list[Violation]:
    """INV-16: every block a sequence writes this step is held by that sequence alone."""
    found: list[Violation] = []
    held = holders(state)
    for seq in batch:
        for block_id in written_blocks(seq, state.block_size):
            ref_count = state.blocks[block_id].ref_count if 0 <= block_id < state.num_blocks else None
            if held[block_id] != 1 or ref_count != 1:
                found.append(Violation(
                    "INV-16", f"seq {seq.seq_id} writes block {block_id}, which {held[block_id]} block tables hold "
                              f"(ref_count {ref_count})"
                ))
    return found


def check_progress(state: SchedulerState, batch: list[SeqView]) -> list[Violation]:
    """INV-18: a step with waiting or running work schedules a non-empty batch."""
    if batch or not (state.waiting or state.running):
        return []
    return [Violation(
        "INV-18", f"empty batch with {len(state.waiting)} waiting and {len(state.running)} running (empty decode)"
    )]


def check_coverage(state: SchedulerState, batch: list[SeqView]) -> list[Violation]:
    """INV-19: a batch sequence's block table has exactly ceil(num_tokens / block_size) blocks."""
    found: list[Violation] = []
    for seq in batch:
        need = blocks_for(seq.num_tokens, state.block_size)
        if len(seq.block_table) != need:
            found.append(Violation(
                "INV-19", f"seq {seq.seq_id} has {len(seq.block_table)} blocks for {seq.num_tokens} tokens, not {need}"
            ))
    return found


def check_unhashed_writes(state: SchedulerState, batch: list[SeqView]) -> list[Violation]:
    """INV-17: a block being written carries no hash, so the prefix cache cannot hand it out."""
    found: list[Violation] = []
    for seq in batch:
        for block_id in written_blocks(seq, state.block_size):
            h = state.blocks[block_id].hash if 0 <= block_id < state.num_blocks else -1
            if h != -1:
                found.append(Violation("INV-17", f"seq {seq.seq_id} writes block {block_id}, which carries hash {h}"))
    return found


def check_placement(state: SchedulerState, batch: list[SeqView], is_prefill: bool) -> list[Violation]:
    """INV-20: where the batch stands in the queues right after schedule(), and its mode."""
    ids = [seq.seq_id for seq in batch]
    if len(set(ids)) != len(ids):
        return [Violation("INV-20", f"batch {ids} names a sequence twice")]
    if is_prefill:
        return prefill_placement(state, batch)
    return decode_placement(state, batch)


def decode_placement(state: SchedulerState, batch: list[SeqView]) -> list[Violation]:
    """INV-20 for decode: every member has is_prefill False, and the batch is the front of running, in order."""
    ids = [seq.seq_id for seq in batch]
    found = [Violation("INV-20", f"decode seq {seq.seq_id} has is_prefill True") for seq in batch if seq.is_prefill]
    front = [seq.seq_id for seq in state.running[: len(batch)]]
    if front != ids:
        found.append(Violation("INV-20", f"decode batch {ids} is not the front of running {front}"))
    return found


def prefill_placement(state: SchedulerState, batch: list[SeqView]) -> list[Violation]:
    """INV-20 for prefill: finished prefills end running in batch order (under ``priority``: are running, each at
    its place, which POLICY-6 judges); a partial one stays at waiting[0]."""
    found = [Violation("INV-20", f"prefill seq {seq.seq_id} has is_prefill False")
             for seq in batch if not seq.is_prefill]
    done = [seq.seq_id for seq in batch if not unfinished(seq)]
    if state.policy == "priority":
        running = {seq.seq_id for seq in state.running}
        if any(seq_id not in running for seq_id in done):
            found.append(Violation("INV-20", f"finished prefills {done} are not all running"))
        tail = done
    else:
        tail = [seq.seq_id for seq in state.running[len(state.running) - len(done) :]] if done else []
    if tail != done:
        found.append(Violation("INV-20", f"finished prefills {done} are not the tail of running {tail}"))
    partial = [seq.seq_id for seq in batch if unfinished(seq)]
    front = [seq.seq_id for seq in state.waiting[: len(partial)]]
    if partial != front:
        found.append(Violation("INV-20", f"partial prefills {partial} are not the front of waiting {front}"))
    return found


def check_mixed_batch(state: SchedulerState, batch: list[SeqView], is_prefill: bool) -> list[Violation]:
    """A ``mixed`` step's batch: its decodes (is_prefill False) are a decode batch at the front of ``running``, the
    rest a prefill batch placed as INV-20 says; the budget bounds the whole step (INV-12 read so, POLICY-2), which
    is a prefill step exactly when it holds a prefill; only the last prefill may be cut short, and only with the
    budget spent (POLICY-3, in place of INV-13)."""
    first = next((i for i, seq in enumerate(batch) if seq.is_prefill), len(batch))
    decodes, prefills = batch[:first], batch[first:]
    ids = [seq.seq_id for seq in batch]
    found = [*check_limits(state, batch, True), *check_decode(decodes, False)]
    if len(set(ids)) != len(ids):
        found.append(Violation("INV-20", f"batch {ids} names a sequence twice"))
    else:
        found += decode_placement(state, decodes)
        if prefills:
            found += prefill_placement(state, prefills)
    if is_prefill != bool(prefills):
        found.append(Violation("POLICY-2", f"the step holds {len(prefills)} prefills but says is_prefill {is_prefill}"))
    cut = [i for i, seq in enumerate(prefills) if unfinished(seq)]
    spent = sum(seq.num_scheduled_tokens for seq in batch) == state.max_num_batched_tokens
    if cut and (cut != [len(prefills) - 1] or not spent):
        found.append(Violation("POLICY-3", f"prefills cut short at positions {cut} of {len(prefills)}, not the last "
                                           "alone with the budget spent"))
    return found
