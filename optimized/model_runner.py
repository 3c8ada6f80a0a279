"""One scheduled batch in, one token per sequence out: inputs, forward, sampling.

The runner owns the paged KV cache, one k and one v tensor per layer of shape
[num_blocks, block_size, kv_heads, head_dim] (views of one allocation). It
computes only the tokens the scheduler granted: positions
[num_cached_tokens, num_cached_tokens + num_scheduled_tokens) of each
sequence, so prefix-cache hits and earlier chunks are read from the cache,
never recomputed, and a preempted sequence (whose blocks were freed) is simply
prefilled again. Inputs are built with numpy array operations, one Python
iteration per sequence and none per token. Logits are computed, and a token
drawn, only for sequences whose prompt is complete after this step; the others
get ``PLACEHOLDER``, which the scheduler discards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from kernels.backend import AttentionBackend
from kernels.rotary import rotary_cos_sin
from kernels.sampling import sample
from optimized.block_math import batch_slot_mapping
from optimized.models.decoder import AttentionContext, CausalLM

PLACEHOLDER = -1  # the token handed to postprocess for an unfinished prefill chunk


class ScheduledSeq(Protocol):
    """What the runner reads from a scheduler's sequence (reference and optimized alike)."""

    @property
    def token_ids(self) -> list[int]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_cached_tokens(self) -> int: ...
    @property
    def num_scheduled_tokens(self) -> int: ...
    @property
    def block_table(self) -> list[int]: ...
    @property
    def last_token(self) -> int: ...


@dataclass(frozen=True)
class DrawParams:
    """How one request's tokens are drawn; ``seed`` is always set (the engine draws one if the user did not)."""

    temperature: float
    top_k: int
    top_p: float
    seed: int


I64 = npt.NDArray[np.int64]


@dataclass
class StepInputs:
    input_ids: I64
    positions: I64
    slot_mapping: I64
    cu_seqlens_q: I64
    context_lens: I64
    block_tables: I64
    sample_rows: I64  # which sequences of the batch get a token
    logit_rows: I64  # their last token's row in the flat batch


def _block_tables(seqs: Sequence[ScheduledSeq]) -> I64:
    width = max(len(s.block_table) for s in seqs)
    table = np.full((len(seqs), width), -1, dtype=np.int64)
    for i, s in enumerate(seqs):
        table[i, : len(s.block_table)] = s.block_table
    return table


def prepare(seqs: Sequence[ScheduledSeq], is_prefill: bool, block_size: int) -> StepInputs:
    """The flat batch of one step: each sequence's granted positions, their slots and the rows to sample."""
    num_tokens = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=len(seqs))
    if is_prefill:
        starts = np.fromiter((s.num_cached_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        ends = starts + np.fromiter((s.num_scheduled_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        input_ids = np.concatenate(
            [np.asarray(s.token_ids[a:b], dtype=np.int64) for s, a, b in zip(seqs, starts, ends, strict=True)]
        )
    else:
        ends = num_tokens
        starts = ends - 1
        input_ids = np.fromiter((s.last_token for s in seqs), dtype=np.int64, count=len(seqs))
    lengths = ends - starts
    cu = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    positions = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1] - starts, lengths)
    block_tables = _block_tables(seqs)
    sample_rows = np.flatnonzero(ends == num_tokens)
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=batch_slot_mapping(block_tables, starts, ends, block_size),
        cu_seqlens_q=cu,
        context_lens=ends,
        block_tables=block_tables,
        sample_rows=sample_rows,
        logit_rows=cu[1:][sample_rows] - 1,
    )


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
    ) -> None:
        c = model.config
        param = model.embed_tokens.weight
        self.model = model
        self.backend = backend
        self.device = param.device
        self.dtype = param.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (2, c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim)
        # Zeroed, so that masked-out slots never hold NaN garbage.
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_views = [(self.kv_cache[0, i], self.kv_cache[1, i]) for i in range(c.num_layers)]
        self.cos_sin = rotary_cos_sin(c.head_dim, max_model_len, c.rope_theta, self.dtype, self.device)

    @staticmethod
    def kv_bytes_per_block(model: CausalLM, block_size: int) -> int:
        c = model.config
        return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * model.embed_tokens.weight.element_size()

    def _tensor(self, a: I64, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.from_numpy(a).to(device=self.device, dtype=dtype)

    @torch.inference_mode()
    def run(self, seqs: Sequence[ScheduledSeq], is_prefill: bool, draws: Sequence[DrawParams]) -> list[int]:
        """One forward over the batch; a token for each sequence (``PLACEHOLDER`` where none is drawn)."""
        inp = prepare(seqs, is_prefill, self.block_size)
        ctx = AttentionContext(
            backend=self.backend,
            is_prefill=is_prefill,
            slot_mapping=self._tensor(inp.slot_mapping),
            cu_seqlens_q=self._tensor(inp.cu_seqlens_q, torch.int32),
            context_lens=self._tensor(inp.context_lens, torch.int32),
            block_tables=self._tensor(inp.block_tables, torch.int32),
            cos_sin=self.cos_sin,
        )
        hidden = self.model(self._tensor(inp.input_ids), self._tensor(inp.positions), ctx, self.kv_views)
        tokens = [PLACEHOLDER] * len(seqs)
        if len(inp.sample_rows) == 0:
            return tokens
        logits = self.model.logits(hidden[self._tensor(inp.logit_rows)]).float()
        rows = [draws[i] for i in inp.sample_rows]
        drawn = sample(
            logits,
            torch.tensor([d.temperature for d in rows], dtype=torch.float32, device=self.device),
            torch.tensor([d.top_k for d in rows], dtype=torch.int64, device=self.device),
            torch.tensor([d.top_p for d in rows], dtype=torch.float32, device=self.device),
            torch.tensor([d.seed for d in rows], dtype=torch.int64, device=self.device),
            self._tensor(inp.context_lens[inp.sample_rows]),
        ).tolist()
        for i, t in zip(inp.sample_rows.tolist(), drawn, strict=True):
            tokens[i] = t
        return tokens
