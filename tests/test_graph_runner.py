"""GraphRunner through the CPU stand-in graph: buckets, padding rows, stale block tables, equality with eager."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import paged_decode, store_kv
from optimized.engine.graph_runner import DecodeMetadata, EagerGraph, GraphRunner, decode_buckets

BLOCK_SIZE, KV_HEADS, HEADS, DIM, VOCAB, NUM_BLOCKS, MAX_BLOCKS = 4, 2, 4, 8, 50, 24, 6


class ToyModel:
    """Embeds ids into q/k/v, stores k/v at the slots, decodes over the paged cache: a one-layer decode step."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.embed = torch.randn(VOCAB, (HEADS + 2 * KV_HEADS) * DIM, generator=gen, dtype=torch.float64)
        self.k_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
        self.v_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
        self.calls = 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: DecodeMetadata) -> torch.Tensor:
        self.calls += 1
        x = self.embed[input_ids] * (1.0 + positions[:, None].double() / 100)
        q, k, v = torch.split(x, [HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
        n = input_ids.shape[0]
        store_kv(
            k.reshape(n, KV_HEADS, DIM), v.reshape(n, KV_HEADS, DIM), self.k_cache, self.v_cache, meta.slot_mapping
        )
        out = paged_decode(
            q.reshape(n, HEADS, DIM), self.k_cache, self.v_cache, meta.context_lens, meta.block_tables, 0.3
        )
        return out.reshape(n, HEADS * DIM)


def step_inputs(
    batch: int, width: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step: sequence b owns blocks [b*width, (b+1)*width) and appends its token at context_len - 1."""
    gen = torch.Generator().manual_seed(seed)
    tables = torch.arange(batch * width, dtype=torch.int32).reshape(batch, width)
    context_lens = torch.randint(1, width * BLOCK_SIZE + 1, (batch,), generator=gen, dtype=torch.int32)
    last = context_lens.long() - 1
    slots = tables.long().gather(1, (last // BLOCK_SIZE)[:, None])[:, 0] * BLOCK_SIZE + last % BLOCK_SIZE
    ids = torch.randint(0, VOCAB, (batch,), generator=gen)
    return ids, last, slots, context_lens, tables


@pytest.mark.clause("KERN-16")
def test_buckets() -> None:
    """KERN-16: powers of two to 8, then multiples of 16, ending at max_batch; a step uses the smallest fit."""
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    runner = GraphRunner(ToyModel().forward, 40, MAX_BLOCKS, torch.device("cpu"))
    assert [runner.bucket_for(b) for b in (1, 2, 3, 5, 9, 17, 33, 40)] == [1, 2, 4, 8, 16, 32, 40, 40]
    for bad in (0, 41):
        with pytest.raises(ValueError, match="batch size"):
            runner.bucket_for(bad)
    with pytest.raises(ValueError, match="block_tables"):
        ids, positions, slots, lens, _ = step_inputs(2, MAX_BLOCKS, 0)
        runner.run(ids, positions, slots, lens, torch.zeros(2, MAX_BLOCKS + 1, dtype=torch.int32))


@pytest.mark.clause("KERN-17", "KERN-19")
def test_replay_equals_eager_and_padding_rows_write_nowhere() -> None:
    """KERN-17, KERN-19: outputs equal the eager forward; padding rows write no KV and yield zeros, not NaN."""
    eager_model, graph_model = ToyModel(), ToyModel()
    runner = GraphRunner(graph_model.forward, 8, MAX_BLOCKS, torch.device("cpu"))
    runner.capture_all()
    assert torch.equal(graph_model.k_cache, eager_model.k_cache)  # capture ran on padding: nothing written
    for step, batch in enumerate([3, 1, 8, 5, 2]):
        ids, positions, slots, lens, tables = step_inputs(batch, 3, seed=step)
        meta = DecodeMetadata(slots, lens, tables)
        expected = eager_model.forward(ids, positions, meta)
        got = runner.run(ids, positions, slots, lens, tables)
        assert got.shape == expected.shape
        # The graph attends over the full static table width; the extra masked columns only change the float32
        # softmax's summation order (softmax is float32 by the eager contract, KERN-3).
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        assert torch.equal(graph_model.k_cache, eager_model.k_cache)
        assert torch.equal(graph_model.v_cache, eager_model.v_cache)
        bucket = runner.bucket_for(batch)
        padded = runner.graphs[bucket].output[batch:bucket]
        assert not padded.isnan().any() and torch.equal(padded, torch.zeros_like(padded))
        assert bool((runner.slot_mapping[batch:] == -1).all()) and bool((runner.context_lens[batch:] == 0).all())
    graph = runner.graphs[8]
    assert isinstance(graph, EagerGraph) and graph.replays == 2  # batches 8 and 5 share bucket 8


@pytest.mark.clause("KERN-18")
def test_stale_block_table_rows_and_columns_are_cleared() -> None:
    """KERN-18: after a wide batch of 4, a narrow batch of 2 leaves no trace of the old rows or columns."""
    model = ToyModel()
    runner = GraphRunner(model.forward, 4, MAX_BLOCKS, torch.device("cpu"))
    runner.run(*step_inputs(4, MAX_BLOCKS, seed=1))
    assert bool((runner.block_tables >= 0).all())
    ids, positions, slots, lens, tables = step_inputs(2, 2, seed=2)
    lens = lens.clamp(max=2 * BLOCK_SIZE)
    runner.run(ids, positions, slots, lens, tables)
    assert torch.equal(runner.block_tables[:2, :2], tables)
    assert bool((runner.block_tables[:2, 2:] == -1).all())
    assert bool((runner.block_tables[2:] == -1).all())
    assert bool((runner.context_lens[2:] == 0).all()) and bool((runner.slot_mapping[2:] == -1).all())


@pytest.mark.clause("KERN-16")
def test_replayed_steps_allocate_no_static_buffers() -> None:
    """KERN-16: buffers and graphs are made once; a replay reuses the same storage and the same graph."""
    model = ToyModel()
    runner = GraphRunner(model.forward, 4, MAX_BLOCKS, torch.device("cpu"))
    runner.capture_all()
    pointers = [t.data_ptr() for t in (runner.input_ids, runner.positions, runner.slot_mapping, runner.block_tables)]
    graphs = dict(runner.graphs)
    outputs = {b: g.output.data_ptr() for b, g in graphs.items()}
    for seed in range(3):
        out = runner.run(*step_inputs(3, 2, seed))
        assert out.data_ptr() == outputs[4]
    assert [t.data_ptr() for t in (runner.input_ids, runner.positions, runner.slot_mapping, runner.block_tables)] == (
        pointers
    )
    assert runner.graphs == graphs
