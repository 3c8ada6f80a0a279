"""The decoder shared by Qwen3, Qwen2 and Llama, over a flat batch of tokens and a paged KV cache.

Tokens of every sequence in a step are concatenated into one [N, hidden] tensor;
``AttentionContext`` says where each one's KV goes (``slot_mapping``) and which
cached KV it attends to (block tables, context lengths). Each layer writes its
new K/V into its cache before attending, so a prefill chunk sees the KV cached
by earlier chunks and by prefix-cache hits. q/k/v and gate/up are packed into
one matrix each (the loader fills the packed rows from the checkpoint's
separate tensors), in the order q, k, v and gate, up. The arithmetic follows
transformers' modeling code op for op so that float64 greedy output matches it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.backend import AttentionBackend
from kernels.norm import add_rms_norm, rms_norm
from kernels.rotary import apply_rotary
from optimized.models.config import ModelConfig


@dataclass
class AttentionContext:
    """One step's attention metadata, shared by every layer."""

    backend: AttentionBackend
    is_prefill: bool
    slot_mapping: torch.Tensor  # int64 [N]
    cu_seqlens_q: torch.Tensor  # int32 [B+1] (prefill only)
    context_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, W], -1 padded
    cos_sin: torch.Tensor  # [max_position, head_dim]
    # Decode only, optional: (first row, end row, table columns) of row ranges whose contexts all fit in that many
    # columns; each range attends on its own, gathering only that width (rows sorted by context length upstream).
    decode_splits: tuple[tuple[int, int, int], ...] = ()


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.num_heads = c.num_heads
        self.num_kv_heads = c.num_kv_heads
        self.head_dim = c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.head_dim**-0.5
        self.eps = c.rms_norm_eps
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=c.o_bias)
        self.q_norm: nn.Parameter | None = None
        self.k_norm: nn.Parameter | None = None
        if c.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(c.head_dim))
            self.k_norm = nn.Parameter(torch.ones(c.head_dim))

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext, kv: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = rms_norm(q, self.q_norm, self.eps)
            k = rms_norm(k, self.k_norm, self.eps)
        q, k = apply_rotary(q, k, positions, ctx.cos_sin)
        k_cache, v_cache = kv
        ctx.backend.store_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
        if ctx.is_prefill:
            o = ctx.backend.prefill(
                q, k_cache, v_cache, ctx.cu_seqlens_q, ctx.context_lens, ctx.block_tables, self.scale
            )
        else:
            o = self._decode(q, k_cache, v_cache, ctx)
        out: torch.Tensor = self.o_proj(o.reshape(n, self.q_size))
        return out

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        if not ctx.decode_splits:
            return ctx.backend.decode(q, k_cache, v_cache, ctx.context_lens, ctx.block_tables, self.scale)
        parts = [
            ctx.backend.decode(
                q[a:b], k_cache, v_cache, ctx.context_lens[a:b], ctx.block_tables[a:b, :width], self.scale
            )
            for a, b, width in ctx.decode_splits
        ]
        return torch.cat(parts)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = c.intermediate_size
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        out: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.eps = c.rms_norm_eps
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = nn.Parameter(torch.ones(c.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(c.hidden_size))

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        ctx: AttentionContext,
        kv: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add of the previous sublayer is fused into this norm.
        if residual is None:
            residual = x
            h = rms_norm(x, self.input_layernorm, self.eps)
        else:
            h, residual = add_rms_norm(x, residual, self.input_layernorm, self.eps)
        h = self.self_attn(h, positions, ctx, kv)
        h, residual = add_rms_norm(h, residual, self.post_attention_layernorm, self.eps)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and the LM head (``lm_head`` shares the embedding when tied)."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(c) for _ in range(c.num_layers)])
        self.norm = nn.Parameter(torch.ones(c.hidden_size))
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Final hidden states [N, hidden] (normed); logits are computed only for the rows sampled."""
        x = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, kv in zip(self.layers, kv_caches, strict=False):
            x, residual = layer(x, residual, positions, ctx, kv)
        assert residual is not None
        out, _ = add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(hidden)
        return out
