"""CUDA-graph decode: graphs captured per batch-size bucket over static input buffers, replayed each step.

Invariants: the static buffers are allocated once, at the widest shape (``max_batch`` rows, ``max_blocks_per_seq``
block-table columns, i.e. the widest table ``max_model_len`` allows), and every graph reads slices of them, so a
replayed step allocates no tensor. A step of B sequences uses the smallest bucket >= B (buckets 1, 2, 4, 8, 16, then
every multiple of 16, up to ``max_batch``). Before each replay every row is rewritten: rows < B get the step's data,
rows >= B become padding — input id 0, position 0, slot -1 (writes nothing), context length 0 (attends to nothing;
the attention kernels return zeros, not NaN, for it) — and the whole block-table buffer is first filled with -1, so
no stale row or column of an earlier, wider step survives. The graph is abstract: ``capture(fn)`` runs fn once and
returns an object whose ``replay()`` re-executes it and whose ``output`` holds the latest result in place — a
``torch.cuda.CUDAGraph`` on CUDA, ``EagerGraph`` (replays the Python function onto the same output tensor) in tests.
On CUDA the forward must be capturable (no host syncs): the runner requires a backend that declares ``capturable``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE


@dataclass(frozen=True)
class DecodeMetadata:
    """The attention inputs of one decode step, as views of the static buffers (row i = sequence i)."""

    slot_mapping: torch.Tensor  # int64 [bucket]
    context_lens: torch.Tensor  # int32 [bucket]
    block_tables: torch.Tensor  # int32 [bucket, max_blocks_per_seq], -1 padded


ForwardFn = Callable[[torch.Tensor, torch.Tensor, DecodeMetadata], torch.Tensor]


class CapturedGraph(Protocol):
    output: torch.Tensor

    def replay(self) -> None: ...


GraphFactory = Callable[[Callable[[], torch.Tensor]], CapturedGraph]


class EagerGraph:
    """Stand-in for a CUDA graph: replay re-runs the function and copies its result into the same output."""

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self._fn = fn
        self.output = fn()
        self.replays = 0

    def replay(self) -> None:
        self.output.copy_(self._fn())
        self.replays += 1


class CudaGraph:
    """A torch.cuda.CUDAGraph of fn, warmed up once on a side stream (Triton compiles there, not in capture)."""

    def __init__(self, fn: Callable[[], torch.Tensor], pool: _POOL_HANDLE) -> None:
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph, pool=pool):
            self.output = fn()

    def replay(self) -> None:
        self._graph.replay()


def cuda_graph_factory() -> GraphFactory:
    """Graphs sharing one memory pool (capture the largest bucket first so smaller ones reuse its memory)."""
    pool = torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], torch.Tensor]) -> CapturedGraph:
        return CudaGraph(fn, pool)

    return capture


def decode_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 48, ... (multiples of 16), always ending with max_batch."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    buckets = [b for b in (1, 2, 4, 8) if b < max_batch]
    buckets += list(range(16, max_batch, 16))
    return [*buckets, max_batch]


class GraphRunner:
    def __init__(
        self,
        forward_fn: ForwardFn,
        max_batch: int,
        max_blocks_per_seq: int,
        device: torch.device,
        graph_factory: GraphFactory | None = None,
    ) -> None:
        if max_blocks_per_seq < 1:
            raise ValueError(f"max_blocks_per_seq must be >= 1, got {max_blocks_per_seq}")
        self.buckets = decode_buckets(max_batch)
        self.max_batch = max_batch
        self.max_blocks_per_seq = max_blocks_per_seq
        self._forward = forward_fn
        self._factory: GraphFactory = graph_factory if graph_factory is not None else EagerGraph
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.full((max_batch, max_blocks_per_seq), -1, dtype=torch.int32, device=device)
        self.graphs: dict[int, CapturedGraph] = {}

    def bucket_for(self, batch: int) -> int:
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"decode batch size must be in [1, {self.max_batch}], got {batch}")
        return next(b for b in self.buckets if b >= batch)

    def capture_all(self) -> None:
        """Capture every bucket, largest first (static buffers hold padding, so capture writes no KV)."""
        for bucket in reversed(self.buckets):
            self._graph(bucket)

    def _graph(self, bucket: int) -> CapturedGraph:
        graph = self.graphs.get(bucket)
        if graph is None:
            meta = DecodeMetadata(self.slot_mapping[:bucket], self.context_lens[:bucket], self.block_tables[:bucket])
            ids, positions = self.input_ids[:bucket], self.positions[:bucket]
            graph = self._factory(lambda: self._forward(ids, positions, meta))
            self.graphs[bucket] = graph
        return graph

    def _load(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> None:
        batch, width = block_tables.shape
        self.input_ids[:batch].copy_(input_ids)
        self.input_ids[batch:].zero_()
        self.positions[:batch].copy_(positions)
        self.positions[batch:].zero_()
        self.slot_mapping[:batch].copy_(slot_mapping)
        self.slot_mapping[batch:].fill_(-1)
        self.context_lens[:batch].copy_(context_lens)
        self.context_lens[batch:].zero_()
        self.block_tables.fill_(-1)
        self.block_tables[:batch, :width].copy_(block_tables)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        """The forward's output for the B real rows (a view of the graph's output, valid until the next run)."""
        batch = input_ids.shape[0]
        bucket = self.bucket_for(batch)
        if block_tables.shape[0] != batch or block_tables.shape[1] > self.max_blocks_per_seq:
            raise ValueError(
                f"block_tables must be [{batch}, <= {self.max_blocks_per_seq}], got {list(block_tables.shape)}"
            )
        self._load(input_ids, positions, slot_mapping, context_lens, block_tables)
        graph = self._graph(bucket)
        graph.replay()
        return graph.output[:batch]
