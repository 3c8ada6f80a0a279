"""The batch-invariant mode under tensor parallelism (spec/parallel.md TP-11, TP-12; BI-7, BI-10), over real gloo
process groups.

The collective alone at 4 ranks: the rank-order all-reduce gives each row the same bits in any tensor and the same
bits on every rank, where gloo's own all-reduce does not (the negative control); the embedding's all-reduce is
exact, signed zeros included. The engine at TP = 2 and TP = 4 (one per size for the module, its workers spawned
as the engine spawns them): a needle gets the same tokens and logits bits alone and in random crowds, its
neighbours' prompts chunked (a token budget of 7) and preempted (24 KV blocks); and the same bits as at TP = 1. The
negative control at TP = 4: the same engine switched to gloo's all-reduce (a store key every rank reads at each
collective; only this test module's workers read it) finds differences.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels import cpu_build
from kernels.linear import BoundLinear, invariant_linear
from optimized.entry.llm import LLM
from optimized.models.config import ModelConfig
from optimized.models.decoder import ChunkedInvariantLinear, VocabParallelEmbedding
from optimized.models.sharding import REDUCTION_CHUNKS, Shard, fixed_order_sum
from optimized.parallel import launch
from optimized.parallel.group import Group, open_store, private_store
from tests.engine_fixtures import at_threads
from tests.test_batch_invariant_engine import NEEDLES, Done, crowd, make, run, same

pytestmark = pytest.mark.usefixtures("engine_env")

PLAIN = "test/plain-all-reduce"  # set in the store: every rank's rank-order all-reduce is gloo's own instead
ROWS = (1, 2, 3, 7, 17)  # the collective test's tensor sizes: rows of WIDTH (the tiny checkpoints' hidden)
WIDTH = 64


@pytest.fixture(autouse=True)
def _kernels_built() -> None:
    if cpu_build.find_compiler() is None:
        pytest.skip("no C compiler on the PATH: the mode is refused")


# --- the fixed order and the chunked linear, in one process ---


@pytest.mark.clause("TP-11", "TP-12")
def test_the_fixed_order_sum_adds_neighbours_in_pairs() -> None:
    """TP-11, TP-12: ``fixed_order_sum`` adds neighbours in pairs, level after level, an odd last part carried:
    ``(p0 + p1) + (p2 + p3)`` for 4 parts (which a chain, ``((p0 + p1) + p2) + p3``, does not round alike: 0
    against 1 here), ``(p0 + p1) + p2`` for 3, the odd part carried to the last level for 5 and 6, and the sum of
    4 is the sum of its two halves' sums."""
    big = [torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8]), torch.tensor([1.0])]
    assert fixed_order_sum([t.clone() for t in big]).item() == 0.0
    assert (((big[0] + big[1]) + big[2]) + big[3]).item() == 1.0
    g = torch.Generator().manual_seed(3)
    p = [torch.randn(5, 7, generator=g) * 10.0 ** (3 * i) for i in range(4)]
    assert torch.equal(fixed_order_sum([t.clone() for t in p]), (p[0] + p[1]) + (p[2] + p[3]))
    assert torch.equal(fixed_order_sum([t.clone() for t in p[:3]]), (p[0] + p[1]) + p[2])
    halves = [fixed_order_sum([t.clone() for t in p[:2]]), fixed_order_sum([t.clone() for t in p[2:]])]
    assert torch.equal(fixed_order_sum(halves), fixed_order_sum([t.clone() for t in p]))
    q = [torch.randn(5, 7, generator=g) * 10.0 ** (3 * (i % 3)) for i in range(6)]
    assert torch.equal(fixed_order_sum([t.clone() for t in q[:5]]), ((q[0] + q[1]) + (q[2] + q[3])) + q[4])
    assert torch.equal(fixed_order_sum([t.clone() for t in q]), ((q[0] + q[1]) + (q[2] + q[3])) + (q[4] + q[5]))
    with pytest.raises(ValueError, match="no parts"):
        fixed_order_sum([])


@pytest.mark.clause("TP-12")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_chunked_linear_is_its_chunks_sums_and_a_shard_computes_whole_chunks(dtype: torch.dtype) -> None:
    """TP-12: a row-parallel layer's product in 4 chunks is ``fixed_order_sum`` of the invariant kernel over each
    chunk; in 1 chunk it is the bound kernel's; two shards of 2 chunks each, their sums added, give the 4-chunk
    product's bits (what 2 ranks compute), and 4 shards of 1 chunk (4 ranks) too; each row is the same bits alone
    as in the batch, at 1 and 2 threads. Which chunks a rank holds follows from the size: 4 / N when N divides 4
    and its columns split, else 1."""
    g = torch.Generator().manual_seed(11)
    k, n = 96, 37
    w = torch.randn(n, k, generator=g, dtype=dtype)
    x = torch.randn(45, k, generator=g, dtype=dtype)
    four = ChunkedInvariantLinear(w, 4)
    with at_threads(2):
        got = four(x)
    q = k // 4
    chunks = [invariant_linear(x[:, a : a + q], w[:, a : a + q]) for a in range(0, k, q)]
    assert torch.equal(got, fixed_order_sum(chunks))
    assert torch.equal(ChunkedInvariantLinear(w, 1)(x), BoundLinear(w)(x))
    halves = [ChunkedInvariantLinear(w[:, a : a + k // 2], 2)(x[:, a : a + k // 2]) for a in (0, k // 2)]
    assert torch.equal(fixed_order_sum(halves), got)
    quarters = [ChunkedInvariantLinear(w[:, a : a + q], 1)(x[:, a : a + q]) for a in range(0, k, q)]
    assert torch.equal(fixed_order_sum(quarters), got)
    assert not torch.equal(BoundLinear(w)(x), got)  # 4 chunks of 24 round otherwise than one block of 64 and one of 32
    for threads in (1, 2):
        with at_threads(threads):
            assert all(torch.equal(four(x[i : i + 1])[0], got[i]) for i in range(x.shape[0]))
    assert [Shard(0, size).reduction_chunks(k // size) for size in (1, 2, 3, 4, 8)] == [4, 2, 1, 1, 1]
    assert [Shard(0, size).reduction_chunks(66 // size) for size in (1, 2, 3)] == [1, 1, 1]
    with pytest.raises(ValueError, match="does not split into 4 equal chunks"):
        ChunkedInvariantLinear(w[:, :66], 4)
    with pytest.raises(ValueError, match="does not fit this layer"):
        four(x[:, :10])


# --- the collective alone, at 4 ranks ---


def _partial(rank: int, rows: int) -> torch.Tensor:
    """Rank ``rank``'s partial sums, the first ``rows`` rows of one fixed draw (so a row is the same in any size)."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(max(ROWS), WIDTH, generator=g)[:rows].clone()


def _table(vocab: int) -> torch.Tensor:
    """An embedding table whose every other element is -0 (the all-reduce must keep signed zeros)."""
    t = torch.randn(vocab, WIDTH, generator=torch.Generator().manual_seed(7))
    t[:, ::2] = -0.0
    return t


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


VOCAB = 4 * 5 - 1  # the embedding's vocabulary: the last of 4 pieces padded
EMBEDDING = ModelConfig("qwen3", VOCAB, WIDTH, 128, 1, 4, 2, 16, 1e-6, 1e4, 64, False, False, False, False, True, ())


def _embedding(group: Group, on: bool) -> VocabParallelEmbedding:
    """This rank's piece of ``_table``'s embedding, the mode ``on`` or off."""
    start, end = group.shard.vocab_range(EMBEDDING)
    emb = VocabParallelEmbedding(group.shard.local_config(EMBEDDING).vocab_size, WIDTH, (start, end), group)
    with torch.no_grad():
        emb.weight.zero_()
        emb.weight[: end - start] = _table(VOCAB)[start:end]
    emb.batch_invariant = on
    return emb


def _collectives(group: Group) -> dict[str, int]:
    """What every rank checks of the collectives: rows of the rank-order all-reduce that differ from the row's own
    all-reduce or from ``fixed_order_sum`` of every rank's partials (0 expected), the same count for gloo's
    all-reduce against the row's own (the negative control), and embedding rows whose bits are not the table's."""
    counts = {"in_rank_order": 0, "not_fixed_order_sum": 0, "plain": 0, "embedding": 0}
    alone: dict[str, list[torch.Tensor]] = {"ordered": [], "plain": []}
    for row in range(max(ROWS)):
        alone["ordered"].append(group.all_reduce_in_rank_order(_partial(group.rank, row + 1)[row:]))
        alone["plain"].append(group.all_reduce(_partial(group.rank, row + 1)[row:].clone()))
    for rows in ROWS:
        ordered = group.all_reduce_in_rank_order(_partial(group.rank, rows))
        plain = group.all_reduce(_partial(group.rank, rows))
        expected = fixed_order_sum([_partial(r, rows) for r in range(group.size)])
        counts["not_fixed_order_sum"] += int((_bits(ordered) != _bits(expected)).any(dim=1).sum())
        for r in range(rows):
            counts["in_rank_order"] += not torch.equal(_bits(ordered[r]), _bits(alone["ordered"][r][0]))
            counts["plain"] += not torch.equal(_bits(plain[r]), _bits(alone["plain"][r][0]))
    ids = torch.tensor([0, 4, 5, 18, 9, 10, 3, 18])
    for on in (True, False):
        got = _embedding(group, on)(ids)
        counts["embedding"] += int((_bits(got) != _bits(_table(VOCAB)[ids])).any(dim=1).sum())
    return counts


def _collective_worker(rank: int, size: int, folder: str) -> None:
    """A spawned rank of the collective test: its counts left in the store for rank 0."""
    torch.set_num_threads(1)
    store = open_store(Path(folder))
    group = Group(store, rank, size, torch.device("cpu"))
    counts = _collectives(group)
    store.set(f"test/counts/{rank}", json.dumps(counts))
    group.compute = group.control = None
    os._exit(0)


@pytest.mark.clause("TP-11")
def test_the_rank_order_all_reduce_is_the_same_bits_in_any_tensor_where_gloos_is_not() -> None:
    """TP-11: over 4 gloo ranks, each row of the rank-order all-reduce of a tensor of 1 to 33 rows of 64 is the
    same bits as that row's all-reduce alone, and is ``fixed_order_sum`` of every rank's partial sums in rank order,
    on every rank; the negative control: gloo's own all-reduce gives rows other bits in a larger tensor (its order
    depends on the size). The embedding's all-reduce (other ranks' rows -0) gives every rank the table's rows
    exactly, signed zeros included, in the mode and out of it."""
    import multiprocessing

    size = 4
    store, folder = private_store()
    ctx = multiprocessing.get_context("spawn")
    workers: list[BaseProcess] = [
        ctx.Process(target=_collective_worker, args=(rank, size, str(folder)), daemon=True) for rank in range(1, size)
    ]
    for w in workers:
        w.start()
    group = Group(store, 0, size, torch.device("cpu"), workers, store_folder=folder)
    try:
        per_rank = [_collectives(group)]
        for rank in range(1, size):
            store.wait([f"test/counts/{rank}"])
            per_rank.append(json.loads(bytes(store.get(f"test/counts/{rank}")).decode()))
        group.join_workers(timeout=30)
    finally:
        group.kill_workers()
        group.compute = group.control = None
    assert [w.exitcode for w in workers] == [0] * (size - 1)
    for got in per_rank:
        assert (got["in_rank_order"], got["not_fixed_order_sum"], got["embedding"]) == (0, 0, 0), got
        assert got["plain"] > 0, got  # gloo's order depends on the tensor's size at 4 ranks


# --- the engine at 2 and 4 ranks ---


def _switchable(ordered: Callable[[Group, torch.Tensor], torch.Tensor]) -> Callable[[Group, torch.Tensor],
                                                                                     torch.Tensor]:
    def all_reduce_in_rank_order(self: Group, t: torch.Tensor) -> torch.Tensor:
        if self.store.check([PLAIN]):
            return self.all_reduce(t.clone())
        return ordered(self, t)

    return all_reduce_in_rank_order


def switchable_worker(*args: Any) -> None:
    """A spawned engine worker (``launch.spawned_worker``) whose rank-order all-reduce is gloo's own while the
    store holds ``PLAIN``."""
    Group.all_reduce_in_rank_order = _switchable(Group.all_reduce_in_rank_order)  # type: ignore[method-assign, assignment]
    launch.spawned_worker(*args)


NEEDLE = 0
_TP1: list[Done] = []


def alone_at_tp1() -> Done:
    """The needle alone in a fresh single-process engine, its whole prompt in one step."""
    if not _TP1:
        _TP1.append(run(make(), [NEEDLES[NEEDLE][0]], [NEEDLES[NEEDLE][1]])[0])
    return _TP1[0]


@pytest.fixture(scope="module", params=[2, 4])
def tp_engine(request: pytest.FixtureRequest) -> Iterator[tuple[int, LLM, Done]]:
    """A mode-on engine of ``param`` ranks (token budget 7, 24 KV blocks of 4), and the needle's run alone in it
    first, while it is fresh."""
    size = int(request.param)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Group, "all_reduce_in_rank_order", _switchable(Group.all_reduce_in_rank_order))
        mp.setattr(launch, "spawned_worker", switchable_worker)
        with make(tensor_parallel_size=size, max_num_batched_tokens=7, num_kvcache_blocks=24) as llm:
            yield size, llm, run(llm, [NEEDLES[NEEDLE][0]], [NEEDLES[NEEDLE][1]])[0]


@pytest.mark.clause("TP-11", "BI-7", "BI-10")
def test_a_needle_in_crowds_is_the_same_bits_as_alone(tp_engine: tuple[int, LLM, Done]) -> None:
    """TP-11, BI-7, BI-10: at 2 and 4 ranks with the mode on, the needle at a random place among random greedy and
    seeded requests, prompts prefilled in chunks of at most 7 tokens, KV blocks so few that the crowd preempts, gets
    the same tokens and logits bits as alone in the same engine when it was fresh."""
    size, llm, alone = tp_engine
    before = llm.stats.chunked_prefills, llm.stats.preemptions
    for seed in range(2):
        prompts, params, at = crowd(random.Random(seed), NEEDLE, 6)
        assert same(run(llm, prompts, params)[at], alone), (size, seed)
    assert llm.stats.chunked_prefills > before[0] and llm.stats.preemptions > before[1], llm.stats


@pytest.mark.clause("TP-12")
def test_one_two_and_four_ranks_give_the_same_bits(tp_engine: tuple[int, LLM, Done]) -> None:
    """TP-12: the needle's tokens and logits at 2 and 4 ranks (its prompt chunked) are the bits of a single process
    (its prompt whole): the row-parallel layers' K chunks line up with the shards, and the rank-order sum adds
    their sums as one process does."""
    size, llm, alone = tp_engine
    assert same(alone, alone_at_tp1())
    assert REDUCTION_CHUNKS % size == 0  # rank 0's down_proj (K = 128 / size) holds 4 / size chunks of 32
    assert llm.engine.runner.model.layers[0].mlp.down_proj.invariant.bounds == tuple(  # type: ignore[union-attr]
        (a, a + 128 // REDUCTION_CHUNKS) for a in range(0, 128 // size, 128 // REDUCTION_CHUNKS))


@pytest.mark.clause("TP-11")
def test_with_gloos_all_reduce_at_four_ranks_the_needle_differs(tp_engine: tuple[int, LLM, Done]) -> None:
    """TP-11's negative control: the 4-rank engine switched to gloo's own all-reduce (every rank, a store key read
    at each collective) gives the needle, alone and then in the same crowds, other logits bits."""
    size, llm, _ = tp_engine
    if size != 4:
        pytest.skip("at 2 ranks gloo adds each element once: there is no order to get wrong")
    group = llm._group
    assert group is not None
    needle = 1  # never run in this engine: no prefix-cache hit on blocks the rank-order sums wrote
    group.store.set(PLAIN, "1")
    try:
        plain_alone = run(llm, [NEEDLES[needle][0]], [NEEDLES[needle][1]])[0]
        differ = 0
        for seed in range(2):
            prompts, params, at = crowd(random.Random(seed), needle, 6)
            differ += not same(run(llm, prompts, params)[at], plain_alone)
    finally:
        group.store.delete_key(PLAIN)
    assert differ > 0
