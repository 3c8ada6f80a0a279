"""The scheduler's step contract (spec/scheduler.md, spec/block-manager.md) as checks on before/after snapshots.

``invariants`` judges one state at a time; these judge a transition: the state
before schedule(), the state right after it and its batch, then the state
after postprocess(). They restate the lesson's decisions independently of any
implementation (the prefix-cache lookup is recomputed here from the hash chain
of CACHE-1), so the same checks hold the reference, the optimized scheduler and
a deliberately broken one to the spec. Each returns every Violation it finds,
named by the spec clause broken, and an empty list for a conforming step.
"""

from __future__ import annotations

import dataclasses
import struct

import xxhash

from invariants import BlockView, SchedulerState, SeqView, Violation
from invariants.block_math import blocks_for, needs_new_block


def chain_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """CACHE-1: the hash of every full block of ``token_ids``, each covering all tokens before it."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = xxhash.xxh64()
        if hashes:
            h.update(hashes[-1].to_bytes(8, "little"))
        block = token_ids[start : start + block_size]
        h.update(struct.pack(f"<{len(block)}q", *block))
        hashes.append(h.intdigest())
    return hashes


def cache_hits(state: SchedulerState, token_ids: list[int]) -> list[int]:
    """BM-3/CACHE-4: the block ids a fresh sequence would reuse; never its last block."""
    bs = state.block_size
    hits: list[int] = []
    for i, h in enumerate(chain_hashes(token_ids, bs)[: blocks_for(len(token_ids), bs) - 1]):
        block_id = state.hash_to_block_id.get(h, -1)
        if block_id == -1 or state.blocks[block_id].token_ids != token_ids[i * bs : (i + 1) * bs]:
            break
        hits.append(block_id)
    return hits


def can_allocate(state: SchedulerState, token_ids: list[int]) -> int:
    """BM-3: -1 when the free queue cannot cover a fresh sequence, else its number of cached blocks."""
    hits = cache_hits(state, token_ids)
    needed = blocks_for(len(token_ids), state.block_size) - sum(b in state.used_block_ids for b in hits)
    return -1 if len(state.free_block_ids) < needed else len(hits)


def allocation_view(state: SchedulerState) -> SchedulerState:
    """A copy of ``state``'s blocks, free queue and hash table that ``allocate`` may change."""
    return dataclasses.replace(state, blocks=list(state.blocks), free_block_ids=list(state.free_block_ids),
                               used_block_ids=set(state.used_block_ids),
                               hash_to_block_id=dict(state.hash_to_block_id), waiting=[], running=[])


def allocate(state: SchedulerState, token_ids: list[int], hits: list[int]) -> None:
    """BM-4 on an ``allocation_view``: take the cached blocks, then fresh ones from the front of the free queue.

    A fresh block's old content is overwritten, so its hash mapping goes (unless it already names a newer
    copy) and its tokens are cleared: a later lookup in the same scan cannot hit it.
    """
    for block_id in hits:
        block = state.blocks[block_id]
        if block_id in state.used_block_ids:
            state.blocks[block_id] = dataclasses.replace(block, ref_count=block.ref_count + 1)
        else:
            state.blocks[block_id] = dataclasses.replace(block, ref_count=1)
            state.free_block_ids.remove(block_id)
            state.used_block_ids.add(block_id)
    fresh = blocks_for(len(token_ids), state.block_size) - len(hits)
    # A batch the free queue cannot cover breaks PREFILL-4, reported elsewhere; the view just runs dry.
    for _ in range(min(fresh, len(state.free_block_ids))):
        block_id = state.free_block_ids.pop(0)
        old_hash = state.blocks[block_id].hash
        if old_hash != -1 and state.hash_to_block_id.get(old_hash) == block_id:
            del state.hash_to_block_id[old_hash]
        state.blocks[block_id] = BlockView(block_id, 1, -1, [])
        state.used_block_ids.add(block_id)


def ids(seqs: list[SeqView]) -> list[int]:
    return [s.seq_id for s in seqs]


def check_schedule(before: SchedulerState, after: SchedulerState, batch: list[SeqView],
                   is_prefill: bool) -> list[Violation]:
    """Every decision of one schedule() call: SCHED-, PREFILL-, CHUNK-, DECODE-, PREEMPT- clauses."""
    if not batch:
        return [Violation("EDGE-2", f"empty batch with {len(before.waiting)} waiting, {len(before.running)} running")]
    return check_prefill(before, after, batch) if is_prefill else check_decode(before, after, batch)


def check_prefill(before: SchedulerState, after: SchedulerState, batch: list[SeqView]) -> list[Violation]:
    waiting_ids = ids(before.waiting)
    if ids(batch) != waiting_ids[: len(batch)]:
        return [Violation("PREFILL-1", f"prefill batch {ids(batch)} is not the front of waiting {waiting_ids}")]
    found: list[Violation] = []
    remaining = before.max_num_batched_tokens
    cache = allocation_view(before)  # each fresh sequence sees the allocations made before it in the scan
    for index, (prior, seq) in enumerate(zip(before.waiting, batch, strict=False)):
        found += check_prefill_member(cache, index, prior, seq, remaining)
        if not prior.block_table:
            allocate(cache, seq.token_ids, cache_hits(cache, seq.token_ids))
        remaining -= seq.num_scheduled_tokens
    found += check_scan_stop(before, after, batch, remaining)
    found += check_prefill_queues(before, after, batch)
    return found


def check_prefill_member(cache: SchedulerState, index: int, prior: SeqView, seq: SeqView,
                         remaining: int) -> list[Violation]:
    """PREFILL-5, CHUNK-1, CHUNK-2 and the cache hits of BM-4 for the index-th sequence of the scan.

    ``cache`` is the block state this sequence's ``can_allocate`` saw: ``before`` with the scan's earlier
    allocations applied.
    """
    found: list[Violation] = []
    if prior.block_table:
        if seq.num_cached_tokens != prior.num_cached_tokens or seq.block_table != prior.block_table:
            found.append(Violation("CHUNK-2", f"seq {seq.seq_id} continued its prefill with a new allocation"))
    else:
        hit_tokens = len(cache_hits(cache, seq.token_ids)) * cache.block_size
        if seq.num_cached_tokens != hit_tokens:
            found.append(Violation("BM-4", f"seq {seq.seq_id} starts with {seq.num_cached_tokens} cached tokens, "
                                           f"the prefix cache holds {hit_tokens}"))
    need = seq.num_tokens - seq.num_cached_tokens
    if seq.num_scheduled_tokens != min(need, remaining):
        found.append(Violation("PREFILL-5", f"seq {seq.seq_id} got {seq.num_scheduled_tokens} tokens, not "
                                            f"min(need {need}, remaining {remaining})"))
    if index > 0 and need > remaining:
        found.append(Violation("CHUNK-1", f"seq {seq.seq_id} at batch position {index} is chunked"))
    return found


def check_scan_stop(before: SchedulerState, after: SchedulerState, batch: list[SeqView],
                    remaining: int) -> list[Violation]:
    """PREFILL-2: the scan ends with waiting, with max_num_seqs, or for one of its three reasons."""
    if len(batch) >= min(len(before.waiting), before.max_num_seqs):
        return []
    nxt = before.waiting[len(batch)]
    # `after` is exactly the state the scan saw when it looked at nxt: nothing changes after the break.
    cached = can_allocate(after, nxt.token_ids)
    need = nxt.num_tokens - cached * after.block_size
    if remaining == 0 or cached == -1 or need > remaining:
        return []
    return [Violation("PREFILL-2", f"the scan stopped before seq {nxt.seq_id} ({need} tokens), which fits "
                                   f"the {remaining} remaining tokens and the free blocks")]


def check_prefill_queues(before: SchedulerState, after: SchedulerState, batch: list[SeqView]) -> list[Violation]:
    """PREFILL-6: finished prefills move to the tail of running in batch order; the rest stay waiting."""
    done = [s.seq_id for s in batch if s.num_cached_tokens + s.num_scheduled_tokens == s.num_tokens]
    found: list[Violation] = []
    if ids(after.running) != ids(before.running) + done:
        found.append(Violation("PREFILL-6", f"running is {ids(after.running)}, expected "
                                            f"{ids(before.running) + done}"))
    if ids(after.waiting) != [i for i in ids(before.waiting) if i not in done]:
        found.append(Violation("PREFILL-6", f"waiting is {ids(after.waiting)} after prefilling {done}"))
    for seq in batch:
        status = "RUNNING" if seq.seq_id in done else "WAITING"
        if seq.status != status:
            found.append(Violation("PREFILL-6", f"seq {seq.seq_id} has status {seq.status}, expected {status}"))
    return found


def check_decode(before: SchedulerState, after: SchedulerState, batch: list[SeqView]) -> list[Violation]:
    found = check_prefill_first(before)
    running = ids(before.running)
    k = len(batch)
    if ids(batch) != running[:k]:
        return [*found, Violation("DECODE-1", f"decode batch {ids(batch)} is not the front of running {running}")]
    for seq in batch:
        if seq.num_scheduled_tokens != 1 or seq.is_prefill:
            found.append(Violation("DECODE-1", f"decode seq {seq.seq_id} schedules {seq.num_scheduled_tokens} "
                                               f"tokens with is_prefill {seq.is_prefill}"))
    waiting_now = ids(after.waiting)
    preempted = [i for i in running if i in waiting_now]
    if waiting_now != preempted + ids(before.waiting):
        found.append(Violation("PREEMPT-3", f"waiting is {waiting_now}, expected the preempted {preempted} "
                                            f"before the old waiting {ids(before.waiting)}"))
    if preempted != running[len(running) - len(preempted) :]:
        found.append(Violation("PREEMPT-2", f"preempted {preempted} are not the newest of running {running}, "
                                            "oldest first"))
    untouched = running[k : len(running) - len(preempted)]
    if ids(after.running) != ids(batch) + untouched:
        found.append(Violation("DECODE-3", f"running is {ids(after.running)}, expected {ids(batch) + untouched}"))
    if untouched and k < before.max_num_seqs:
        found.append(Violation("DECODE-2", f"{untouched} were neither scheduled nor preempted with room for "
                                           f"{before.max_num_seqs - k} more"))
    found += check_preempted(before, after, preempted)
    return found


def check_prefill_first(before: SchedulerState) -> list[Violation]:
    """SCHED-2: a decode step runs only when the head of waiting cannot be prefilled."""
    if not before.waiting:
        return []
    head = before.waiting[0]
    if head.block_table or can_allocate(before, head.token_ids) != -1:
        return [Violation("SCHED-2", f"a decode step ran although waiting head seq {head.seq_id} fits")]
    return []


def check_preempted(before: SchedulerState, after: SchedulerState, preempted: list[int]) -> list[Violation]:
    """PREEMPT-1 (discard and recompute) and DECODE-2 (preemption only when a block is needed and none is free)."""
    found: list[Violation] = []
    prior = {s.seq_id: s for s in before.running}
    now = {s.seq_id: s for s in after.waiting}
    for seq_id in preempted:
        seq = now[seq_id]
        kept = seq.token_ids == prior[seq_id].token_ids
        if seq.status != "WAITING" or not seq.is_prefill or seq.block_table or seq.num_cached_tokens or not kept:
            found.append(Violation("PREEMPT-1", f"preempted seq {seq_id} is not a fresh WAITING prefill with its "
                                                f"tokens kept: {seq}"))
    victims = predicted_victims(before)
    expected = [i for i in ids(before.running) if i in victims]  # `preempted` is in running order too
    if preempted != expected:
        found.append(Violation("DECODE-2", f"preempted {preempted}; the decode loop's block arithmetic from the "
                                           f"state before preempts {expected}"))
    return found


def predicted_victims(before: SchedulerState) -> list[int]:
    """DECODE-2 replayed on block counts alone: a sequence that needs a block takes a free one, else victims
    from the tail of running (or, alone, itself) release theirs until one is free."""
    running = list(before.running)
    free = len(before.free_block_ids)
    ref_counts = {b.block_id: b.ref_count for b in before.blocks}
    victims: list[int] = []
    scheduled = 0
    while running and scheduled < before.max_num_seqs:
        seq = running.pop(0)
        needs = needs_new_block(seq.num_tokens, before.block_size)
        while needs and free == 0:
            victim = running.pop() if running else seq
            victims.append(victim.seq_id)
            free += released(victim, ref_counts)
            if victim is seq:
                break
        else:
            free -= needs
            scheduled += 1
    return victims


def released(seq: SeqView, ref_counts: dict[int, int]) -> int:
    """PREEMPT-1: deallocating ``seq`` frees the blocks no other table still holds."""
    freed = 0
    for block_id in seq.block_table:
        ref_counts[block_id] -= 1
        freed += ref_counts[block_id] == 0
    return freed


def check_postprocess(scheduled: SchedulerState, after: SchedulerState, batch: list[SeqView], tokens: list[int],
                      is_prefill: bool, eos: int, ignore_eos: dict[int, bool]) -> list[Violation]:
    """POST-1..3 and CACHE-2/3: the bookkeeping of one postprocess() call."""
    live = {s.seq_id: s for s in [*after.running, *after.waiting]}
    found: list[Violation] = []
    finishing: set[int] = set()
    for seq, token in zip(batch, tokens, strict=True):
        found += check_hashed(after, seq)
        cached = seq.num_cached_tokens + seq.num_scheduled_tokens
        if is_prefill and cached < seq.num_tokens:
            expected_tokens, finished = seq.token_ids, False
        else:
            expected_tokens = [*seq.token_ids, token]
            completion = len(expected_tokens) - seq.num_prompt_tokens
            finished = (not ignore_eos[seq.seq_id] and token == eos) or completion == seq.max_tokens
        if finished:
            finishing.add(seq.seq_id)
        found += check_member_after(seq, live.get(seq.seq_id), expected_tokens, cached, finished, after)
    # Expected from the state before postprocess, so a sequence that vanishes outside the batch is seen.
    still = [i for i in ids(scheduled.running) if i not in finishing]
    if ids(after.running) != still or ids(after.waiting) != ids(scheduled.waiting):
        found.append(Violation("POST-3", f"postprocess reordered the queues: running {ids(after.running)}, "
                                         f"waiting {ids(after.waiting)}"))
    return found


def check_member_after(seq: SeqView, now: SeqView | None, expected_tokens: list[int], cached: int, finished: bool,
                       after: SchedulerState) -> list[Violation]:
    if finished:
        if now is not None:
            return [Violation("POST-3", f"seq {seq.seq_id} should have finished but is still {now.status}")]
        held = {b for s in [*after.running, *after.waiting] for b in s.block_table}
        kept = [b for b in seq.block_table if b not in held and b not in after.free_block_ids]
        return [Violation("POST-3", f"finished seq {seq.seq_id} did not release blocks {kept}")] if kept else []
    if now is None:
        return [Violation("POST-3", f"seq {seq.seq_id} finished early")]
    found: list[Violation] = []
    if now.token_ids != expected_tokens:
        clause = "POST-2" if len(expected_tokens) == seq.num_tokens else "POST-3"
        found.append(Violation(clause, f"seq {seq.seq_id} holds {now.token_ids}, expected {expected_tokens}"))
    if now.num_cached_tokens != cached or now.num_scheduled_tokens != 0:
        found.append(Violation("POST-1", f"seq {seq.seq_id} has {now.num_cached_tokens} cached and "
                                         f"{now.num_scheduled_tokens} scheduled tokens, expected {cached} and 0"))
    return found


def check_hashed(after: SchedulerState, seq: SeqView) -> list[Violation]:
    """CACHE-2: the blocks this step filled carry their chain hash and are findable in the table."""
    bs = after.block_size
    start = seq.num_cached_tokens // bs
    end = (seq.num_cached_tokens + seq.num_scheduled_tokens) // bs
    hashes = chain_hashes(seq.token_ids, bs)
    found: list[Violation] = []
    for i in range(start, end):
        block = after.blocks[seq.block_table[i]]
        mapped = after.hash_to_block_id.get(hashes[i], -1)
        # A later batch member with the same prefix may own the mapping; it must carry the same hash.
        mapped_ok = mapped != -1 and after.blocks[mapped].hash == hashes[i]
        if block.hash != hashes[i] or block.token_ids != seq.token_ids[i * bs : (i + 1) * bs] or not mapped_ok:
            found.append(Violation("CACHE-2", f"block {block.block_id} (block {i} of seq {seq.seq_id}) was not "
                                              "registered with its chain hash"))
    return found
