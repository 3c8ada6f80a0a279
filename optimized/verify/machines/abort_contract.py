"""The abort contract (spec/abort.md, ABORT-1..3 and FAULT-2) as checks on before/after snapshots.

BEYOND THE LESSON, like the chapter it checks. The expected state after an
abort is computed here from the state before it, independently of any
implementation: the sequence leaves its queue and every other sequence stays
as it was; its blocks are released as ``deallocate`` releases them (reverse
table order, freed at ref_count 0, to the tail of the free queue); no block's
content, hash or prefix-table entry changes. A failed step's expected state is
its batch's grants withdrawn, then each member aborted in batch order. Each
check returns every Violation it finds, named by the clause broken.
"""

from __future__ import annotations

import copy
import dataclasses

from invariants import SchedulerState, Violation


def expected_after_abort(state: SchedulerState, seq_id: int) -> SchedulerState:
    """ABORT-1..3: the state ``state`` becomes when sequence ``seq_id`` is aborted (a deep copy)."""
    out = copy.deepcopy(state)
    seq = next(s for s in [*out.waiting, *out.running] if s.seq_id == seq_id)
    out.waiting = [s for s in out.waiting if s.seq_id != seq_id]
    out.running = [s for s in out.running if s.seq_id != seq_id]
    for block_id in reversed(seq.block_table):
        block = out.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            out.used_block_ids.discard(block_id)
            out.free_block_ids.append(block_id)
    return out


def expected_after_abort_step(scheduled: SchedulerState, batch: list[int]) -> SchedulerState:
    """FAULT-2: grants withdrawn without postprocess, then every member aborted in batch order."""
    out = copy.deepcopy(scheduled)
    out.waiting = [dataclasses.replace(s, num_scheduled_tokens=0) for s in out.waiting]
    out.running = [dataclasses.replace(s, num_scheduled_tokens=0) for s in out.running]
    for seq_id in batch:
        out = expected_after_abort(out, seq_id)
    return out


def _differences(expected: SchedulerState, actual: SchedulerState) -> dict[str, str]:
    """Clause-sized parts of the two states that differ, each with a short account."""
    found: dict[str, str] = {}
    queues = (expected.waiting, expected.running), (actual.waiting, actual.running)
    if queues[0] != queues[1]:
        found["queues"] = (f"waiting {[s.seq_id for s in actual.waiting]}, running {[s.seq_id for s in actual.running]}"
                           f"; expected {[s.seq_id for s in expected.waiting]}, "
                           f"{[s.seq_id for s in expected.running]} with every other sequence unchanged")
    release = ([b.ref_count for b in expected.blocks], expected.free_block_ids, expected.used_block_ids)
    if release != ([b.ref_count for b in actual.blocks], actual.free_block_ids, actual.used_block_ids):
        found["release"] = f"free queue {actual.free_block_ids}, expected {expected.free_block_ids} (or ref counts)"
    contents = [(b.hash, b.token_ids) for b in expected.blocks], expected.hash_to_block_id
    if contents != ([(b.hash, b.token_ids) for b in actual.blocks], actual.hash_to_block_id):
        found["cache"] = "a block's hash or tokens, or the prefix table, changed"
    return found


def check_abort(before: SchedulerState, after: SchedulerState, seq_id: int) -> list[Violation]:
    """ABORT-1 (queues), ABORT-2 (release), ABORT-3 (prefix cache kept) for one abort between steps."""
    clauses = {"queues": "ABORT-1", "release": "ABORT-2", "cache": "ABORT-3"}
    found = _differences(expected_after_abort(before, seq_id), after)
    return [Violation(clauses[part], f"abort of seq {seq_id}: {text}") for part, text in found.items()]


def check_abort_step(scheduled: SchedulerState, after: SchedulerState, batch: list[int]) -> list[Violation]:
    """FAULT-2: the state after failing the step that scheduled ``batch``, from the state right after schedule()."""
    found = _differences(expected_after_abort_step(scheduled, batch), after)
    return [Violation("FAULT-2", f"failed step {batch}: {text}") for text in found.values()]
