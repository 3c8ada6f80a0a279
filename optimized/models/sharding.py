"""Which part of the model one tensor-parallel rank holds (the Megatron layout), and what is refused.

Invariant: for a world of ``size`` ranks, every weight of the checkpoint is either split into ``size``
disjoint equal pieces (one per rank) or held whole by every rank, and the split is a pure function of the
config and the rank, so every rank computes the same plan without talking (TP-4). Column-parallel (rows of the
checkpoint matrix split): q, k, v, gate, up (weights and biases), the embedding and the LM head (by vocabulary).
Row-parallel (columns split, partial sums all-reduced, the bias added once after): o_proj and down_proj. Norms are
whole on every rank. The vocabulary is cut into ``ceil(vocab_size / size)`` rows per rank, the last rank's
piece padded with zero rows whose logits are dropped when gathered, so any vocabulary size splits (as vLLM pads
it). KV heads are split like query heads; when ``size`` exceeds their count, each rank holds one
KV head, the one its query heads read (replicated over ``size // num_kv_heads`` ranks, as vLLM does), which needs
``size`` to be a multiple of the KV head count (TP-5).

In the batch-invariant mode a row-parallel layer's K is also cut into ``REDUCTION_CHUNKS`` equal consecutive chunks,
whose sums are added by ``fixed_order_sum``, so a shard holds whole chunks and 1, 2 or 4 ranks add the same sums in
the same order (TP-12).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from optimized.models.config import ModelConfig

REDUCTION_CHUNKS = 4  # a row-parallel layer's K chunks in the batch-invariant mode (TP-12)


def fixed_order_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The element-wise sum of ``parts`` in an order fixed by their count alone: neighbours added in pairs, level
    after level (``(p0 + p1) + (p2 + p3)``; an odd last part joins the next level as it is). For a count that is a
    power of two, the sum of each aligned half is this sum of that half, so ranks that each add their own
    consecutive parts, then the ranks' sums, round exactly as one process adding every part (TP-11, TP-12). The
    parts are consumed: each pair's sum is written into its left part, and the result is the first part."""
    level = list(parts)
    if not level:
        raise ValueError("fixed_order_sum of no parts")
    while len(level) > 1:
        paired = [level[i].add_(level[i + 1]) for i in range(0, len(level) - 1, 2)]
        level = paired + level[len(paired) * 2 :]
    return level[0]


def check_divisible(c: ModelConfig, size: int) -> None:
    """ValueError naming the config field that ``size`` ranks cannot split evenly (TP-5)."""
    fields = (
        ("num_attention_heads", c.num_heads),
        ("intermediate_size", c.intermediate_size),
    )
    for name, value in fields:
        if value % size:
            raise ValueError(f"tensor_parallel_size={size}: config.json {name}={value} is not divisible by {size}")
    kv = c.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(
            f"tensor_parallel_size={size}: config.json num_key_value_heads={kv} is neither divisible by {size} "
            f"nor a divisor of it (to replicate each KV head over {size} // {kv} ranks)"
        )


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size``: its row ranges of each split weight, in checkpoint coordinates."""

    rank: int
    size: int

    def local_config(self, c: ModelConfig) -> ModelConfig:
        """The config of this rank's piece: its heads, KV heads, MLP width and vocabulary slice."""
        return replace(
            c,
            num_heads=c.num_heads // self.size,
            num_kv_heads=max(1, c.num_kv_heads // self.size),
            intermediate_size=c.intermediate_size // self.size,
            vocab_size=-(-c.vocab_size // self.size),  # padded: every rank's piece has the same rows
        )

    def vocab_range(self, c: ModelConfig) -> tuple[int, int]:
        """The token ids whose rows this rank holds (fewer than its piece's rows on a padded last rank)."""
        part = -(-c.vocab_size // self.size)
        return min(self.rank * part, c.vocab_size), min((self.rank + 1) * part, c.vocab_size)

    def q_rows(self, c: ModelConfig) -> tuple[int, int]:
        part = c.num_heads // self.size * c.head_dim
        return self.rank * part, (self.rank + 1) * part

    def kv_rows(self, c: ModelConfig) -> tuple[int, int]:
        """This rank's KV heads; with fewer KV heads than ranks, the one head its query heads share."""
        heads = max(1, c.num_kv_heads // self.size)
        first = self.rank * c.num_kv_heads // self.size
        return first * c.head_dim, (first + heads) * c.head_dim

    def mlp_rows(self, c: ModelConfig) -> tuple[int, int]:
        part = c.intermediate_size // self.size
        return self.rank * part, (self.rank + 1) * part

    def reduction_chunks(self, in_features: int) -> int:
        """How many of the ``REDUCTION_CHUNKS`` chunks of a row-parallel layer's K this rank's ``in_features``
        columns hold (TP-12): ``REDUCTION_CHUNKS // size`` when ``size`` divides ``REDUCTION_CHUNKS`` and the columns
        split into that many equal chunks; else 1, the whole shard summed as one chunk."""
        if REDUCTION_CHUNKS % self.size:
            return 1
        chunks = REDUCTION_CHUNKS // self.size
        return chunks if in_features % chunks == 0 and in_features >= chunks else 1


# Checkpoint module suffix -> (dimension split, which range); dimension 0: rows (column-parallel), 1: columns.
SPLIT = {
    "self_attn.q_proj": (0, "q"),
    "self_attn.k_proj": (0, "kv"),
    "self_attn.v_proj": (0, "kv"),
    "mlp.gate_proj": (0, "mlp"),
    "mlp.up_proj": (0, "mlp"),
    "self_attn.o_proj": (1, "q"),
    "mlp.down_proj": (1, "mlp"),
}


def source_slice(shard: Shard, c: ModelConfig, name: str) -> tuple[int, int, int] | None:
    """(dimension, start, end) of checkpoint tensor ``name`` that ``shard`` holds; None: the whole tensor."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (0, *shard.vocab_range(c))
    module, _, kind = name.rpartition(".")
    for suffix, (dim, which) in SPLIT.items():
        if module.endswith(suffix):
            if dim == 1 and kind == "bias":
                return None  # a row-parallel bias is whole, added once after the all-reduce
            rows = {"q": shard.q_rows, "kv": shard.kv_rows, "mlp": shard.mlp_rows}[which](c)
            return (dim, *rows)
    return None
