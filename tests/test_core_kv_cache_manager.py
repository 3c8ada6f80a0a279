"""The KV-cache manager: the prefix cache, its log, the block pool and the walk memo (OPT-7, OPT-8, OPT-14..17)."""


from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

import optimized.core.kv_cache_manager as kvm
import reference
from invariants import snapshot
from optimized.core.scheduler import Scheduler, SchedulerConfig, Sequence
from optimized.core.walk_memo import WalkMemo
from optimized.engine.sampling_params import SamplingParams
from tests.optimized_pair import Computed, Pair, RecordedChain, expected_chain, requests, twin_run


@pytest.mark.clause("OPT-7", "OPT-16")
def test_each_full_block_is_hashed_at_most_once_per_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    """OPT-7, OPT-16: prefix hits, preemptions and re-prefills never hash a sequence's block twice.

    Every xxh64 call is counted, and every hash that lands in a sequence's chain cache is logged as
    (request, block index): the calls must equal the logged slots, so no computation goes unattributed.
    """
    calls: list[bytes] = []
    hashed: list[tuple[int, int]] = []
    taken: list[tuple[int, int]] = []
    seqs: list[Sequence] = []
    preempted: list[int] = []
    real_hash, real_add, real_preempt = xxhash.xxh64_intdigest, Scheduler.add, Scheduler._preempt

    def counting(data: bytes) -> int:
        calls.append(data)
        return real_hash(data)

    def add(self: Scheduler, seq: Sequence, stop_token_ids: Iterable[int] = ()) -> None:
        seq.core.hashes = RecordedChain(len(seqs), hashed, taken)
        seqs.append(seq)
        real_add(self, seq, frozenset(stop_token_ids))

    def preempt(self: Scheduler, seq: Sequence) -> None:
        preempted.append(seqs.index(seq))
        real_preempt(self, seq)

    real_chain = kvm.chain_hashes
    monkeypatch.setattr(kvm, "xxh64_intdigest", counting)
    monkeypatch.setattr(kvm, "chain_hashes", lambda prefix, pieces: Computed(real_chain(prefix, pieces)))
    monkeypatch.setattr(Scheduler, "add", add)
    monkeypatch.setattr(Scheduler, "_preempt", preempt)
    block_size, shared, prompt, max_tokens = 2, 4, 5, 10
    workload = {"config": {"block_size": block_size, "num_blocks": 12, "max_num_seqs": 8, "max_num_batched_tokens": 16,
                           "eos": 0}, "requests": requests(4, prompt, max_tokens, shared=shared)}
    ref, opt = twin_run(workload, 400)
    assert ref.is_finished() and opt.is_finished()
    snapshot(opt)  # flushes every pending registration
    assert preempted  # the chains must survive preemptions and re-prefills
    # Each request ends at 9 + 10 tokens; the KV of all but the last was computed, so full blocks 0..8 were each
    # looked up or registered, hence needed once. The 4 shared tokens are blocks 0 and 1, byte-equal across requests.
    full = (shared + prompt + max_tokens - 1) // block_size
    common = shared // block_size
    # Step 1 (16-token budget): request 0's walk hashes its block 0 only (nothing registered yet, so it misses);
    # request 1 is walked beside it (7 tokens left, the walk precedes the chunk check) and takes request 0's only
    # hash. Step 2 applies request 0's registration first; requests 2 and 3, first chained from 1 and from 2, then
    # find both common blocks hashed (OPT-16).
    taken_first = {0: 0, 1: 1, 2: common, 3: common}
    assert sorted(taken) == [(r, i) for r in range(4) for i in range(taken_first[r])]
    assert len(set(hashed)) == len(hashed)
    assert sorted(hashed) == [(r, i) for r in range(4) for i in range(taken_first[r], full)]
    assert len(calls) == len(hashed) == 4 * full - sum(taken_first.values()) == 31
    for seq in seqs:  # and what was taken or hashed is the chain the reference would compute
        tokens, prev, chain = seq.token_ids, -1, []
        for i in range(full):
            piece = np.array(tokens[i * block_size:(i + 1) * block_size], dtype="<i8").tobytes()
            prev = real_hash(piece if prev == -1 else prev.to_bytes(8, "little") + piece)
            chain.append(prev)
        assert list(seq.core.hashes) == chain


@pytest.mark.clause("OPT-8")
def test_registrations_wait_until_the_table_is_read() -> None:
    """OPT-8: a filled block is only logged; a lookup or an inspection applies the log, in order."""
    opt = Scheduler(SchedulerConfig(num_blocks=16, block_size=2, max_num_batched_tokens=64))
    ref = reference.Scheduler(reference.SchedulerConfig(num_blocks=16, block_size=2, max_num_batched_tokens=64))
    opt.add(Sequence([1, 2, 3, 4, 5], SamplingParams(max_tokens=5, ignore_eos=True), 2))
    ref.add(reference.Sequence([1, 2, 3, 4, 5], reference.SamplingParams(max_tokens=5, ignore_eos=True), 2))
    for s in (opt, ref):
        batch, pf = s.schedule()
        s.postprocess(batch, [6], pf)  # type: ignore[arg-type]
    seq = opt.running[0]
    assert opt.block_manager.pending == [kvm.FullBlocks(seq, 0, seq.block_table[:2])]  # a typed entry
    assert opt.block_manager._table == {}
    assert opt.block_manager.hash_to_block_id == ref.block_manager.hash_to_block_id  # reading flushed it
    assert not opt.block_manager.pending


@pytest.mark.clause("OPT-14")
def test_takes_from_never_used_blocks_forget_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """OPT-14: while the free queue's front is in its never-used part, a take touches no hash and no log."""
    def forbidden(self: kvm.KVCacheManager, ids: list[int]) -> None:
        raise AssertionError(f"forgot hashes of never-used blocks {ids}")

    monkeypatch.setattr(kvm.KVCacheManager, "_forget", forbidden)
    p = Pair(block_size=2, num_blocks=400, max_num_seqs=4, max_num_batched_tokens=16)
    for i in range(6):
        p.add([i + 1] * 5, 9)
    while p.step():
        pass
    p.agree()
    assert p.opt.block_manager.free.front <= p.opt.block_manager.pool.clean_end


@pytest.mark.clause("OPT-14", "OPT-8")
def test_takes_past_the_never_used_blocks_forget_their_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """OPT-14, OPT-8: once takes reach recycled blocks, their hashes leave the table as the reference's do."""
    forgotten: list[int] = []
    real = kvm.KVCacheManager._forget

    def counting(self: kvm.KVCacheManager, ids: list[int]) -> None:
        forgotten.extend(ids)
        real(self, ids)

    monkeypatch.setattr(kvm.KVCacheManager, "_forget", counting)
    p = Pair(block_size=2, num_blocks=12, max_num_seqs=4, max_num_batched_tokens=16)
    for i in range(6):
        p.add([i + 1] * 5, 6)
    while p.step():
        p.agree()
    assert forgotten


@pytest.mark.clause("OPT-15")
def test_the_remembered_walk_is_always_the_walk_the_reference_would_make() -> None:
    """OPT-15: after every call the memo (cut, freed or dropped as events came) equals a fresh walk."""
    p = Pair(block_size=2, num_blocks=14, max_num_seqs=6, max_num_batched_tokens=12)
    for i in range(8):
        p.add([1, 2, 3, 4] + [i + 5] * (3 + i % 4), 8 + i % 3)
    bm = p.opt.block_manager
    walks = asks = checked = 0
    real_walk, real_ask = bm._walk, bm.can_allocate

    def walk(seq: Sequence) -> WalkMemo:
        nonlocal walks
        walks += 1
        return real_walk(seq)

    def ask(seq: Sequence) -> int:
        nonlocal asks
        asks += 1
        return real_ask(seq)

    bm._walk, bm.can_allocate = walk, ask  # type: ignore[method-assign]
    while p.step():
        bm.flush()
        memo = bm._memo
        if memo is not None:
            kept = (memo.cached, memo.used, memo.hits[: memo.cached])
            fresh = real_walk(memo.seq)
            assert kept == (fresh.cached, fresh.used, fresh.hits)
            checked += 1
        p.agree()
    assert checked and walks < asks  # the head that waited was not walked again on every step


@pytest.mark.clause("OPT-15")
def test_a_hit_freed_before_its_admission_is_no_longer_held_in_the_walk_memo() -> None:
    """OPT-15: a remembered walk whose hit was freed, then cut by a take, counts that hit as free, not held.

    The waiting sequence's walk hits blocks of a running one; that one finishes (the hits go free), and a
    take from the free queue's reused part unmaps a hit (the walk is cut): the memo's count of held hits
    must follow, or the admission test and the chosen blocks differ from the reference's.
    """
    p = Pair(block_size=2, num_blocks=5, max_num_seqs=1, max_num_batched_tokens=16)
    assert p.run([([1], 4, 0), ([1, 3, 1], 3, 1), ([1, 3, 1, 1, 2, 1], 2, 3)]) > 3


@pytest.mark.clause("OPT-16")
def test_shared_leading_blocks_take_the_last_chain_and_stay_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """OPT-16: equal leading blocks reuse the previous chain's hashes; every chain equals the reference's."""
    a, b, c = [1] * 4, [2] * 4, [3] * 4
    # Shares of one and two blocks, none, and a sequence whose source shares as many blocks as an older,
    # unrelated pair did (the remembered common prefix must not be taken for its own).
    prompts = [[*a, *c, 9], [*a, *b, 9], [*b, *a, 9], [*b, *c, 9], [*a, *c, *b, 9], [*a, *a, *c, *b, 9],
               [*a, *a, *c, 9], [*c, 9]]
    calls: list[bytes] = []
    real = xxhash.xxh64_intdigest

    def counting(data: bytes) -> int:
        calls.append(data)
        return real(data)

    monkeypatch.setattr(kvm, "xxh64_intdigest", counting)
    opt = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=4))
    seqs = [Sequence(prompt, SamplingParams(max_tokens=2), 4) for prompt in prompts]
    for seq in seqs:
        opt.add(seq)
        opt.block_manager.extend_chain(seq, len(seq) // 4)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.core.hashes == expected_chain(prompt, 4)
        assert [bytes(p) for p in seq.core.pieces] == [np.array(prompt[i : i + 4], "<i8").tobytes()
                                                   for i in range(0, len(prompt) - 4, 4)]
    assert len(calls) < sum(len(p) // 4 for p in prompts)


@pytest.mark.clause("OPT-7")
@given(st.lists(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=4, max_size=4), max_size=5))
def test_the_one_chain_hash_is_the_references(blocks: list[list[int]]) -> None:
    """OPT-7: ``chain_hash``, the only place the optimized scheduler hashes, is compute_hash; ``chain_hashes``
    chains it."""
    pieces = [np.array(b, dtype="<i8").tobytes() for b in blocks]
    assert kvm.chain_hashes(-1, pieces) == expected_chain([t for b in blocks for t in b], 4)
    source = Path(kvm.__file__).read_text()
    if blocks:
        assert kvm.chain_hash(-1, pieces[0]) == expected_chain(blocks[0], 4)[0]
    assert source.count("xxh64_intdigest(") == 1 and source.count("chain_hash(") == 3  # its def and two calls


@pytest.mark.clause("OPT-17")
def test_a_logged_decode_fill_lands_after_its_sequence_finished() -> None:
    """OPT-17: fills logged by step are registered from the member's segment even after its table was released."""
    p = Pair(block_size=4, num_blocks=40, max_num_seqs=4, max_num_batched_tokens=64)
    p.add([5, 6, 7], 14)
    p.add([8, 9, 1, 2, 3], 6)
    while p.step():
        pass
    bm = p.opt.block_manager
    assert any(isinstance(entry, kvm.DecodeFills) for entry in bm.pending)  # decode fills waited: nobody read the table
    assert all(not s.block_table for s in p.opt_seqs)
    again = p.add(p.ref_seqs[0].token_ids[:13], 3)  # its blocks 0..2 all filled while decoding
    (rb, rp), (ob, op) = p.ref.schedule(), p.opt.schedule()
    assert rb == [p.ref_seqs[again]] and ob == [p.opt_seqs[again]]
    assert ob[0].num_cached_tokens == rb[0].num_cached_tokens == 12
    assert ob[0].block_table == rb[0].block_table
    p.ref.postprocess(rb, [1], rp)
    p.opt.postprocess(ob, [1], op)
    while p.step():
        pass
    p.agree()


@pytest.mark.clause("OPT-17")
def test_a_preempted_member_segments_resolve_each_fill_to_its_own_table() -> None:
    """OPT-17: a member preempted and rejoined has two segments; fills of both register the right blocks."""
    p = Pair(block_size=2, num_blocks=10, max_num_seqs=4, max_num_batched_tokens=32)
    for i in range(3):
        p.add([i + 1, i + 2, i + 3], 9)
    while p.step():
        p.agree()


@pytest.mark.clause("OPT-17")
def test_a_fill_logged_before_a_member_rejoined_resolves_to_its_earlier_segment() -> None:
    """OPT-17: a decode fill logged in a member's first stay, flushed after it left and rejoined, finds that stay.

    A copy of the batch handed to postprocess makes the members leave the group without a flush, and grow
    one token without the group's clock; the next decode step rejoins them (a new segment) while the earlier
    step's fill is still in the log. After two such steps a later segment's ``length - clock`` is two more
    than the first one's: read from it, the fill would name the wrong block. The flush must walk back from
    the last segment to the one covering the fill's clock.
    """
    p = Pair(block_size=2, num_blocks=40, max_num_seqs=2, max_num_batched_tokens=16)
    p.add([1, 2, 3], 8)
    p.add([4, 5, 6], 8)
    p.step()  # prefill: lengths 4
    p.step()  # decode at clock 0: the members' second blocks fill, logged as one entry for clock 0
    bm = p.opt.block_manager
    assert [entry.clock for entry in bm.pending if isinstance(entry, kvm.DecodeFills)] == [0]
    p.step(copy_batch=True)  # the group dissolves, nothing is flushed
    p.step(copy_batch=True)  # they rejoin at clock 1 (a second segment) and leave again
    p.step()  # they rejoin at clock 1: a third segment
    members = p.opt._group.members
    assert len(members) == 2 and all(len(seq.core.segments) == 3 for seq in members)
    assert all(seq.core.segments[-1][0] == 1 for seq in members)  # the logged clock 0 is in the first segment
    assert all(seq.core.segments[-1][1] == seq.core.segments[0][1] + 2 for seq in members)
    assert [entry.clock for entry in bm.pending if isinstance(entry, kvm.DecodeFills)] == [0]
    p.agree()  # flushes: the fill must register the blocks of the first segment's table
    while p.step():
        p.agree()


@pytest.mark.clause("OPT-15", "OPT-1")
def test_decisions_and_the_remembered_walk_stay_the_references_when_hashes_collide(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """OPT-15: with a chain hash of five values (both schedulers), hash hits over other tokens are everywhere.

    Every walk then meets collisions: a hit whose block holds other tokens ends it, and that block is reused and
    refilled while a walk is remembered. The batches must stay the reference's and, after every step, the
    remembered walk must equal a fresh one (the block at a collision is not watched, OPT-15).
    """
    import random

    import reference.block_manager as rbm

    real_reference, real_optimized = rbm.compute_hash, xxhash.xxh64_intdigest
    monkeypatch.setattr(rbm, "compute_hash", lambda token_ids, prefix=-1: real_reference(token_ids, prefix) % 5)
    monkeypatch.setattr(kvm, "xxh64_intdigest", lambda data: real_optimized(data) % 5)
    contents: set[bytes] = set()
    checked = 0
    for seed in range(40):
        rng = random.Random(seed)
        p = Pair(block_size=2, num_blocks=rng.randint(5, 9), max_num_seqs=rng.randint(1, 3),
                 max_num_batched_tokens=rng.choice([4, 8, 16]))
        arrivals = sorted(([rng.randint(1, 3) for _ in range(rng.randint(1, 7))], rng.randint(1, 4),
                           rng.randint(0, 6)) for _ in range(rng.randint(2, 6)))
        arrivals = [a for a in arrivals if -(-(len(a[0]) + a[1] - 1) // 2) <= p.opt.config.num_blocks]
        arrivals.sort(key=lambda a: a[2])
        bm, steps = p.opt.block_manager, 0
        while arrivals or p.step():
            while arrivals and arrivals[0][2] <= steps:
                prompt, max_tokens, _ = arrivals.pop(0)
                p.add(prompt, max_tokens)
            steps += 1
            p.agree(invariants=False)  # INV-2 assumes no collision (the reference breaks it too then)
            bm.flush()
            memo = bm._memo
            if memo is not None:
                kept = (memo.cached, memo.used, memo.hits[: memo.cached])
                fresh = bm._walk(memo.seq)
                assert kept == (fresh.cached, fresh.used, fresh.hits)
                checked += 1
            contents.update(bm._contents.values())
    assert checked > 50 and len(contents) > 2 * 5  # many more distinct blocks than hash values


def _five_hash_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both schedulers' chain hash reduced to five values: a run of (1, 1) blocks chains 2, 2, 2, ..."""
    import reference.block_manager as rbm

    real_reference, real_optimized = rbm.compute_hash, xxhash.xxh64_intdigest
    monkeypatch.setattr(rbm, "compute_hash", lambda token_ids, prefix=-1: real_reference(token_ids, prefix) % 5)
    monkeypatch.setattr(kvm, "xxh64_intdigest", lambda data: real_optimized(data) % 5)


@pytest.mark.clause("OPT-14", "OPT-15")
def test_hits_that_repeat_a_block_are_each_a_holder(monkeypatch: pytest.MonkeyPatch) -> None:
    """OPT-14: after a hash collision a walk's hits can name one block twice ([2, 2, 2]); taking them adds a holder
    per hit, and the block stays used while any holder runs (hold's fast path is for hits that do not repeat)."""
    _five_hash_values(monkeypatch)
    p = Pair(block_size=2, num_blocks=12, max_num_seqs=4, max_num_batched_tokens=64)
    p.add([1] * 7, 6)
    assert p.step()
    p.add([1] * 7, 2)
    steps, repeated = 1, False
    while p.step():
        p.agree(invariants=False)
        table = p.opt_seqs[1].block_table
        repeated = repeated or len(set(table)) < len(table)
        steps += 1
    assert steps > 3 and repeated  # the repeated hits were taken


@pytest.mark.clause("OPT-15")
def test_a_freed_block_frees_every_hit_that_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """OPT-15: a remembered walk whose hits repeat one block (a collision) marks every one of them free when that
    block is released, as a fresh walk would; else the admission test counts freed hits as held."""

    _five_hash_values(monkeypatch)
    p = Pair(block_size=2, num_blocks=5, max_num_seqs=4, max_num_batched_tokens=16)
    p.add([1, 1, 1, 1, 9], 5)  # its blocks 0 and 1 both hash to 2 (the table keeps block 1)
    p.add([7, 7, 7], 5)  # no block is left free
    p.step()
    p.add([1] * 7, 2)  # walks hits [1, 1, 1], all used, and waits: the walk is kept
    p.step()
    bm = p.opt.block_manager
    assert bm._memo is not None and bm._memo.hits[:3] == [1, 1, 1]
    p.ref.abort(p.ref_seqs[0])
    p.opt.abort(p.opt_seqs[0])  # block 1 goes free
    bm.flush()
    memo, fresh = bm._memo, bm._walk(p.opt_seqs[2])
    assert memo is not None and (memo.cached, memo.used) == (fresh.cached, fresh.used) == (3, 0)
    while p.step():
        p.agree(invariants=False)


@pytest.mark.clause("OPT-15", "MUT-8")
def test_stale_walk_reports_a_remembered_walk_that_a_fresh_walk_contradicts() -> None:
    """OPT-15, MUT-8: the machine's oracle is silent on a true memo and names what differs on a corrupted one."""
    sched = Scheduler(SchedulerConfig(num_blocks=4, block_size=2, max_num_seqs=2, eos=0))
    holder = sched.new_sequence([1, 2, 3, 4, 5], 2, ignore_eos=True)
    sched.add(holder)
    out = sched.schedule()
    sched.postprocess(out.batch, [6], out.is_prefill)  # holder's two full blocks are registered and held
    waiter = sched.new_sequence([1, 2, 3, 4, 9, 9, 9, 9], 2)  # hits both, needs four blocks: it waits
    sched.add(waiter)
    out = sched.schedule()
    bm = sched.block_manager
    memo = bm._memo
    assert memo is not None and memo.seq is waiter and memo.held == [True, True] and bm.stale_walk() == ""
    memo.held[0] = False  # a held hit marked free, the count left as it was
    assert bm.stale_walk().startswith(f"OPT-15: the walk remembered for sequence {waiter.seq_id}")
    memo.held[0] = True
    sched.postprocess(out.batch, [6], out.is_prefill)
    assert bm.stale_walk() == ""
