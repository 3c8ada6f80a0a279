"""spec/block-manager.md and the config's edges, clause by clause, on the reference block manager."""

from __future__ import annotations

import struct

import pytest
import xxhash

from reference import BlockManager, SamplingParams, SchedulerConfig, Sequence, compute_hash

BS = 4


def seq(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams(max_tokens=8), BS)


def take(bm: BlockManager, s: Sequence) -> int:
    cached = bm.can_allocate(s)
    assert cached != -1
    bm.allocate(s, cached)
    return cached


def fill(bm: BlockManager, s: Sequence) -> None:
    """Compute the whole prompt in one step, as postprocess would (hash_blocks then the counters)."""
    s.num_scheduled_tokens = len(s) - s.num_cached_tokens
    bm.hash_blocks(s)
    s.num_cached_tokens += s.num_scheduled_tokens
    s.num_scheduled_tokens = 0


def partition_ok(bm: BlockManager, tables: list[list[int]]) -> bool:
    free, used = set(bm.free_block_ids), bm.used_block_ids
    counts = {b: sum(t.count(b) for t in tables) for b in range(len(bm.blocks))}
    return (free | used == set(range(len(bm.blocks))) and not free & used
            and all(bm.blocks[b].ref_count == counts[b] for b in range(len(bm.blocks))))


@pytest.mark.clause("BM-1", "BM-2", "BM-5")
def test_fresh_blocks_come_from_the_front_and_return_to_the_back() -> None:
    """BM-1, BM-2, BM-5: FIFO free queue; deallocate releases the table from its end; ids never lost."""
    bm = BlockManager(6, BS)
    a, b = seq(list(range(10))), seq(list(range(100, 105)))
    take(bm, a)
    take(bm, b)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4]
    assert partition_ok(bm, [a.block_table, b.block_table])
    bm.deallocate(a)
    assert list(bm.free_block_ids) == [5, 2, 1, 0] and a.block_table == [] and a.num_cached_tokens == 0
    assert partition_ok(bm, [b.block_table])
    c = seq(list(range(200, 208)))
    take(bm, c)
    assert c.block_table == [5, 2]
    assert bm.blocks[5].ref_count == 1 and bm.blocks[5].hash == -1  # reset for its new owner


@pytest.mark.clause("BM-3", "BM-4", "CACHE-5")
def test_can_allocate_counts_hits_and_the_blocks_they_save() -> None:
    """BM-3, BM-4, CACHE-5: a hit on a used block is shared; a hit on a free one still takes a free block."""
    bm = BlockManager(4, BS)
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    a = seq([*prefix, 9])
    take(bm, a)
    fill(bm, a)  # blocks 0 and 1 are full and hashed
    b = seq([*prefix, 10, 11])
    assert bm.can_allocate(b) == 2  # 3 blocks, 2 of them shared: needs 1 of the 1 free
    bm.allocate(b, 2)
    assert b.block_table == [0, 1, 3] and b.num_cached_tokens == 8
    assert bm.blocks[0].ref_count == 2 and bm.blocks[1].ref_count == 2
    assert bm.can_allocate(seq([*prefix, 12])) == -1  # 1 block needed, none free
    bm.deallocate(a)
    bm.deallocate(b)
    assert list(bm.free_block_ids) == [2, 3, 1, 0]  # a's 2, then b's 3, 1, 0: each table from its end
    c = seq([*prefix, 13])
    # Both hits are free blocks now: 3 blocks needed, 4 free, and the cached ones leave the queue where they are.
    assert bm.can_allocate(c) == 2
    bm.allocate(c, 2)
    assert c.block_table == [0, 1, 2] and list(bm.free_block_ids) == [3]


@pytest.mark.clause("CACHE-4", "BM-3")
def test_the_last_block_is_never_a_hit() -> None:
    """CACHE-4, BM-3: a prompt that is exactly two full cached blocks still recomputes its last block."""
    bm = BlockManager(8, BS)
    a = seq(list(range(8)))
    take(bm, a)
    fill(bm, a)
    b = seq(list(range(8)))
    assert bm.can_allocate(b) == 1


@pytest.mark.clause("CACHE-4")
def test_a_hash_hit_needs_equal_tokens() -> None:
    """CACHE-4: a mapped block whose tokens differ (a collision) is no hit."""
    bm = BlockManager(8, BS)
    a = seq(list(range(9)))
    take(bm, a)
    fill(bm, a)
    bm.blocks[a.block_table[0]].token_ids = [9, 9, 9, 9]  # as if another block's tokens hashed the same
    assert bm.can_allocate(seq(list(range(9)))) == 0


@pytest.mark.clause("CACHE-1")
def test_hash_chain_is_xxh64_over_previous_hash_and_int64_tokens() -> None:
    """CACHE-1: the spec's byte layout, computed here from scratch."""
    first = xxhash.xxh64(struct.pack("<4q", 1, 2, 3, 4)).intdigest()
    second = xxhash.xxh64(first.to_bytes(8, "little") + struct.pack("<4q", 5, 6, 7, 8)).intdigest()
    assert compute_hash([1, 2, 3, 4]) == first
    assert compute_hash([5, 6, 7, 8], first) == second
    assert compute_hash([5, 6, 7, 8]) != second  # the same tokens after another prefix hash differently


@pytest.mark.clause("CACHE-2")
def test_hash_blocks_registers_the_blocks_this_step_filled() -> None:
    """CACHE-2: only blocks completed by this step's tokens, chained from the block before them."""
    bm = BlockManager(8, BS)
    a = seq(list(range(11)))
    take(bm, a)
    a.num_scheduled_tokens = 6  # a chunk: tokens 0..5 fill block 0 only
    bm.hash_blocks(a)
    a.num_cached_tokens, a.num_scheduled_tokens = 6, 5
    assert bm.blocks[0].hash == compute_hash([0, 1, 2, 3]) and bm.blocks[1].hash == -1
    bm.hash_blocks(a)  # tokens 6..10 fill block 1; block 2 stays partial
    h1 = compute_hash([4, 5, 6, 7], bm.blocks[0].hash)
    assert bm.blocks[1].hash == h1 and bm.blocks[1].token_ids == [4, 5, 6, 7]
    assert bm.hash_to_block_id == {bm.blocks[0].hash: 0, h1: 1} and bm.blocks[2].hash == -1


@pytest.mark.clause("CACHE-3")
def test_released_blocks_keep_their_hash_until_taken_again() -> None:
    """CACHE-3: a finished sequence's prefix is still a hit; reusing the block forgets the mapping."""
    bm = BlockManager(3, BS)
    a = seq(list(range(5)))
    take(bm, a)
    fill(bm, a)
    h = bm.blocks[0].hash
    bm.deallocate(a)
    assert bm.blocks[0].hash == h and bm.hash_to_block_id[h] == 0
    assert bm.can_allocate(seq(list(range(6)))) == 1
    other = seq(list(range(50, 62)))  # takes 2, 1, 0: block 0 is overwritten
    take(bm, other)
    assert other.block_table == [2, 1, 0] and h not in bm.hash_to_block_id
    assert bm.can_allocate(seq(list(range(6)))) == -1


@pytest.mark.clause("BM-6")
def test_a_new_block_is_needed_exactly_when_the_last_token_opens_one() -> None:
    """BM-6: can_append / may_append test len % block_size == 1."""
    bm = BlockManager(3, BS)
    a = seq(list(range(4)))
    take(bm, a)
    fill(bm, a)
    a.append_token(99)  # length 5: token 4 opens block 1
    assert bm.can_append(a)
    bm.may_append(a)
    assert a.block_table == [0, 1]
    a.append_token(98)  # length 6: fits block 1
    bm.may_append(a)
    assert a.block_table == [0, 1]
    take(bm, seq(list(range(10, 14))))  # the last free block goes to another sequence
    assert not bm.free_block_ids
    assert bm.can_append(a)  # length 6: no block needed, none free
    for t in (97, 96, 95):
        a.append_token(t)
    assert len(a) % BS == 1 and not bm.can_append(a)


@pytest.mark.clause("EDGE-1")
def test_block_size_one_takes_no_block_and_then_indexes_past_the_table() -> None:
    """EDGE-1: with block_size 1, len % 1 == 1 never holds, so decode takes no block and hash_blocks overruns."""
    bm = BlockManager(4, 1)  # built directly: SchedulerConfig would refuse block_size 1
    a = Sequence([7, 8], SamplingParams(max_tokens=8), 1)
    cached = bm.can_allocate(a)
    bm.allocate(a, cached)
    fill(bm, a)  # the prefill step: one block per token, both hashed
    assert a.block_table == [0, 1] and list(bm.free_block_ids) == [2, 3]
    a.append_token(9)  # the sampled token: length 3 needs a third block
    assert bm.can_append(a)  # asks for len % 1 == 1, i.e. nothing
    bm.may_append(a)
    assert a.block_table == [0, 1] and list(bm.free_block_ids) == [2, 3]  # took nothing though one was needed
    a.num_scheduled_tokens = 1  # the decode step computes token 2, which has no block
    with pytest.raises(IndexError):
        bm.hash_blocks(a)


@pytest.mark.clause("KNOB-4", "EDGE-1")
@pytest.mark.parametrize(("field", "value"), [
    ("block_size", 1), ("block_size", 0), ("num_blocks", 0), ("max_num_seqs", 0),
    ("max_num_batched_tokens", 0), ("num_blocks", 2.0), ("eos", True),
])
def test_config_refuses_bad_knobs_naming_the_field(field: str, value: object) -> None:
    """KNOB-4, EDGE-1: a bad value raises ValueError naming the field; block_size 1 is refused."""
    kwargs: dict[str, object] = {"num_blocks": 4, "block_size": 4, field: value}
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]
