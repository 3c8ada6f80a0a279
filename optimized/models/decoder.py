"""The decoder shared by Qwen3, Qwen2 and Llama, over a flat batch of tokens and a paged KV cache.

Tokens of every sequence in a step are concatenated into one [N, hidden] tensor;
``AttentionContext`` says where each one's KV goes (``slot_mapping``) and which
cached KV it attends to (block tables, context lengths). Each layer writes its
new K/V into its cache before attending, so a prefill chunk sees the KV cached
by earlier chunks and by prefix-cache hits. Attention goes through the step's
backend only (``store_kv``, then ``prefill`` or ``decode`` with the backend's
own plan for the step): no attention kernel is called past it. q/k/v and gate/up are packed into
one matrix each (the loader fills the packed rows from the checkpoint's
separate tensors), in the order q, k, v and gate, up. The arithmetic follows
transformers' modeling code op for op so that float64 greedy output matches it.

Under tensor parallelism (spec/parallel.md, TP-4) a model is one rank's piece: its modules are built from the
shard's local config, o_proj and down_proj all-reduce their partial sums before adding their bias, the embedding
looks up only its vocabulary slice (other ids give -0) and all-reduces, and ``logits`` gathers the vocabulary
slices to rank 0. In the batch-invariant mode those all-reduces add in rank order, and a row-parallel layer sums its
K in ``REDUCTION_CHUNKS`` fixed chunks, at TP = 1 too (TP-11, TP-12). With no ``tp`` every module is the plain one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kernels.backend import AttentionBackend, DecodePlan
from kernels.linear import BoundLinear, invariant_silu_mul
from kernels.norm import add_rms_norm, rms_norm
from kernels.rotary import rotary_rows, rotate
from optimized.models.config import ModelConfig
from optimized.models.sharding import Shard

Rows = tuple[tuple[int, int], ...]


@dataclass
class AttentionContext:
    """One step's attention metadata, shared by every layer: what every backend needs, and the backend's own plan
    for the step (made by its ``plan_decode`` when it asks for one, handed back to its ``decode`` untouched)."""

    backend: AttentionBackend
    is_prefill: bool
    slot_mapping: torch.Tensor  # int64 [N]
    cu_seqlens_q: torch.Tensor  # int32 [B+1] (prefill only)
    context_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, W], -1 padded
    cos_sin: torch.Tensor  # [max_position, head_dim]
    decode_plan: DecodePlan | None = None


class TensorParallel(Protocol):
    """The collectives a sharded model calls (optimized/parallel/group.py), over the ranks of ``shard.size``."""

    shard: Shard

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of every rank's ``t``, on every rank."""
        ...

    def all_reduce_in_rank_order(self, t: torch.Tensor) -> torch.Tensor:
        """That sum added by ``fixed_order_sum`` over the ranks' ``t`` in rank order, the same bits on every rank
        whatever ``t``'s size (TP-11)."""
        ...

    def gather_columns(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` side by side along the last dimension, in rank order, on rank 0 (``t`` elsewhere)."""
        ...


class ChunkedInvariantLinear(BoundLinear):
    """``x @ weight.T`` with K cut into ``chunks`` equal consecutive chunks: each chunk's sum by the invariant kernel
    (BI-2's rule over the chunk's K), the chunks' sums added in ``fixed_order_sum``'s order (TP-12); no bias. One
    kernel call computes every chunk and their sum (``bounds``: each chunk's columns). Needs the compiled library."""

    def __init__(self, weight: torch.Tensor, chunks: int) -> None:
        super().__init__(weight, None, chunks)
        k, step = self.in_features, self.in_features // chunks
        self.bounds = tuple((a, a + step) for a in range(0, k, step)) if k else ((0, 0),)


class Linear(nn.Linear):
    """``nn.Linear`` whose product is MKL's or, once ``bind_invariant(True)``, the batch-invariant kernel bound to
    this layer's weight (bind again after replacing the weight)."""

    invariant: BoundLinear | ChunkedInvariantLinear | None = None

    def bind_invariant(self, on: bool) -> None:
        self.invariant = BoundLinear(self.weight.detach(), self._fused_bias()) if on else None

    def _fused_bias(self) -> torch.Tensor | None:
        """The bias the kernel adds itself."""
        return None if self.bias is None else self.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant is None:
            return F.linear(x, self.weight, self.bias)
        return self.invariant(x)


class RowParallelLinear(Linear):
    """A linear layer over this rank's input columns: partial sums all-reduced, then the (whole) bias added. In the
    batch-invariant mode its K is summed in fixed chunks, the partial sums added in rank order, then the bias (TP-11,
    TP-12): at TP = 1 too, so 1, 2 and 4 ranks give the same bits."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel | None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def bind_invariant(self, on: bool) -> None:
        shard = Shard(0, 1) if self.tp is None else self.tp.shard
        chunks = shard.reduction_chunks(self.in_features)
        self.invariant = ChunkedInvariantLinear(self.weight.detach(), chunks) if on else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant is None:
            if self.tp is None:
                return F.linear(x, self.weight, self.bias)
            out = self.tp.all_reduce(F.linear(x, self.weight))
        else:
            out = self.invariant(x)
            if self.tp is not None:
                out = self.tp.all_reduce_in_rank_order(out)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """An embedding of this rank's vocabulary slice ``[start, end)`` (its first ``end - start`` rows; the rest is
    padding): ids outside it give -0, and the all-reduce gives every rank every id's row exactly, signed zeros
    included (x + -0 is x for every x); in rank order in the batch-invariant mode (TP-11)."""

    def __init__(self, rows: int, hidden: int, held: tuple[int, int], tp: TensorParallel | None) -> None:
        super().__init__(rows, hidden)
        self.start, self.end = held
        self.tp = tp
        self.batch_invariant = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return super().forward(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), -0.0)
        return self.tp.all_reduce_in_rank_order(out) if self.batch_invariant else self.tp.all_reduce(out)


def row_slices(n: int, chunk: int) -> Rows:
    """``[0, n)`` cut into consecutive slices of ``chunk`` rows (the whole range when ``chunk`` is 0 or >= n)."""
    if chunk <= 0 or n <= chunk:
        return ((0, n),)
    return tuple((a, min(a + chunk, n)) for a in range(0, n, chunk))


def _by_rows(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], rows: Rows, *args: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn`` over each row slice of its tensor arguments (None passes through), outputs concatenated: the same
    values as one call, since every op inside is row-wise."""
    if len(rows) == 1:
        return fn(*args)
    parts = [fn(*(None if t is None else t[a:b] for t in args)) for a, b in rows]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.num_heads = c.num_heads
        self.num_kv_heads = c.num_kv_heads
        self.head_dim = c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.head_dim**-0.5
        self.eps = c.rms_norm_eps
        self.qkv_proj = Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, c.hidden_size, c.o_bias, tp)
        self.q_norm: nn.Parameter | None = None
        self.k_norm: nn.Parameter | None = None
        if c.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(c.head_dim))
            self.k_norm = nn.Parameter(torch.ones(c.head_dim))

    def project(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        ctx: AttentionContext,
        kv: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """q (normed and rotated) of rows ``x``; their k and v are stored in the cache. q and k sit side by side in
        the packed projection, so they are normed (per-head weights side by side) and rotated as one tensor: each
        element sees the same operations as with q and k apart."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            weight = torch.cat([self.q_norm.expand(self.num_heads, -1), self.k_norm.expand(self.num_kv_heads, -1)])
            qk = rms_norm(qk, weight, self.eps)
        qk = rotate(qk, cos, sin)
        ctx.backend.store_kv(qk[:, self.num_heads :], v, kv[0], kv[1], slots)
        return qk[:, : self.num_heads]

    def attend(self, q: torch.Tensor, ctx: AttentionContext, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Attention output ``[N, h * d]`` of queries ``q[N, h, d]`` over the cache (new KV stored already)."""
        k_cache, v_cache = kv
        if ctx.is_prefill:
            o = ctx.backend.prefill(
                q, k_cache, v_cache, ctx.cu_seqlens_q, ctx.context_lens, ctx.block_tables, self.scale
            )
        else:
            o = ctx.backend.decode(
                q, k_cache, v_cache, ctx.context_lens, ctx.block_tables, self.scale, ctx.decode_plan
            )
        return o.reshape(q.shape[0], self.q_size)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.intermediate_size = c.intermediate_size
        self.gate_up_proj = Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, c.mlp_bias, tp)
        self.batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``down(silu(gate) * up)``; in the batch-invariant mode SiLU is ``g / (1 + exp(-g))`` (BI-8), in float32
        the C kernel's, fused with ``* up``."""
        gate_up = self.gate_up_proj(x)
        if self.batch_invariant and gate_up.dtype == torch.float32:
            return self._down(invariant_silu_mul(gate_up, self.intermediate_size))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        act = gate / (1 + torch.exp(-gate)) if self.batch_invariant else F.silu(gate)
        return self._down(act * up)

    def _down(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(h)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.eps = c.rms_norm_eps
        self.self_attn = Attention(c, tp)
        self.mlp = MLP(c, tp)
        self.input_layernorm = nn.Parameter(torch.ones(c.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(c.hidden_size))

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: AttentionContext,
        kv: tuple[torch.Tensor, torch.Tensor],
        rows: Rows,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual)``; the row-wise halves before and after attention run slice by slice."""

        def before(
            x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            # The residual add of the previous sublayer is fused into this norm.
            if residual is None:
                residual, h = x, rms_norm(x, self.input_layernorm, self.eps)
            else:
                h, residual = add_rms_norm(x, residual, self.input_layernorm, self.eps)
            return self.self_attn.project(h, cos, sin, slots, ctx, kv), residual

        q, residual = _by_rows(before, rows, x, residual, rope[0], rope[1], ctx.slot_mapping)
        return _by_rows(self._after, rows, self.self_attn.attend(q, ctx, kv), residual)

    def _after(self, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = add_rms_norm(self.self_attn.o_proj(o), residual, self.post_attention_layernorm, self.eps)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and the LM head (``lm_head`` shares the embedding when tied).

    ``config`` is the whole model's; ``local_config`` that of this rank's piece (the same without ``tp``)."""

    def __init__(self, c: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = c
        self.tp = tp
        local = c if tp is None else tp.shard.local_config(c)
        self.local_config = local
        held = (0, c.vocab_size) if tp is None else tp.shard.vocab_range(c)
        self.embed_tokens = VocabParallelEmbedding(local.vocab_size, c.hidden_size, held, tp)
        self.layers = nn.ModuleList([DecoderLayer(local, tp) for _ in range(c.num_layers)])
        self.norm = nn.Parameter(torch.ones(c.hidden_size))
        self.lm_head = Linear(c.hidden_size, local.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.batch_invariant = False

    def set_batch_invariant(self, on: bool) -> None:
        """Every linear layer and the LM head on the invariant kernel (bound to the weights as they are now, so
        after loading them), and the MLPs' SiLU on its invariant form; or all back to MKL and ``F.silu`` (BI-7)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.bind_invariant(on)
            elif isinstance(module, MLP | VocabParallelEmbedding):
                module.batch_invariant = on
        self.batch_invariant = on

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        row_chunk: int = 0,
    ) -> torch.Tensor:
        """Final hidden states [N, hidden] (normed); logits are computed only for the rows sampled. A step of more
        than ``row_chunk`` rows runs its row-wise work in slices of that many rows (0: the whole batch, ENG-30)."""
        x = self.embed_tokens(input_ids)
        rope = rotary_rows(positions, ctx.cos_sin, x.dtype)
        rows = row_slices(x.shape[0], row_chunk)
        residual: torch.Tensor | None = None
        for layer, kv in zip(self.layers, kv_caches, strict=False):
            x, residual = layer(x, residual, rope, ctx, kv, rows)
        assert residual is not None
        out, _ = add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of rows ``hidden``; under tensor parallelism, whole on rank 0 only (its slice elsewhere)."""
        out: torch.Tensor = self.lm_head(hidden)
        if self.tp is None:
            return out
        return self.tp.gather_columns(out)[..., : self.config.vocab_size]  # the padding's columns dropped
