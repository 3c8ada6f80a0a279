"""A random Qwen3 checkpoint of any shape, made on the target device and saved as a Hugging Face folder.

Invariants: the folder holds config.json and model.safetensors with Hugging Face tensor names (separate q/k/v
and gate/up; no ``lm_head.weight`` when embeddings are tied), so the engine's loader and transformers'
``from_pretrained`` both read it as they would a downloaded checkpoint. The weights are a pure function of
(shape, seed, device kind): normal draws scaled by 1/sqrt(fan_in), so activations keep their size through the
layers and greedy output varies; norm weights are ones. Drawing happens on the device (fast for 0.6B
parameters on a GPU); only the finished tensors are copied to the host to be written.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from optimized.benchmarks.gpu_profile import ModelShape


def _layer_shapes(s: ModelShape) -> dict[str, tuple[int, int]]:
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return {
        "self_attn.q_proj": (q, s.hidden),
        "self_attn.k_proj": (kv, s.hidden),
        "self_attn.v_proj": (kv, s.hidden),
        "self_attn.o_proj": (s.hidden, q),
        "mlp.gate_proj": (s.intermediate, s.hidden),
        "mlp.up_proj": (s.intermediate, s.hidden),
        "mlp.down_proj": (s.hidden, s.intermediate),
    }


def random_weights(s: ModelShape, dtype: torch.dtype, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)

    def normal(rows: int, cols: int, scale: float) -> torch.Tensor:
        w = torch.randn(rows, cols, generator=g, device=device, dtype=torch.float32) * scale
        return w.to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype, device=device)

    w = {"model.embed_tokens.weight": normal(s.vocab, s.hidden, 1.0)}
    for i in range(s.layers):
        p = f"model.layers.{i}."
        for name, (rows, cols) in _layer_shapes(s).items():
            w[f"{p}{name}.weight"] = normal(rows, cols, cols**-0.5)
        w[f"{p}input_layernorm.weight"] = ones(s.hidden)
        w[f"{p}post_attention_layernorm.weight"] = ones(s.hidden)
        w[f"{p}self_attn.q_norm.weight"] = ones(s.head_dim)
        w[f"{p}self_attn.k_norm.weight"] = ones(s.head_dim)
    w["model.norm.weight"] = ones(s.hidden)
    if not s.tie_embeddings:
        w["lm_head.weight"] = normal(s.vocab, s.hidden, s.hidden**-0.5)
    return w


def num_parameters(s: ModelShape) -> int:
    """Distinct parameters of the model (the tied lm_head counted once)."""
    per_layer = sum(r * c for r, c in _layer_shapes(s).values()) + 2 * s.hidden + 2 * s.head_dim
    head = 0 if s.tie_embeddings else s.vocab * s.hidden
    return s.vocab * s.hidden + s.layers * per_layer + s.hidden + head


def write_random_checkpoint(folder: Path, s: ModelShape, dtype: torch.dtype, device: torch.device, seed: int) -> int:
    """Write the checkpoint into ``folder`` (created); the bytes of model.safetensors."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(s.config(str(dtype).removeprefix("torch.")), indent=2))
    weights = random_weights(s, dtype, device, seed)
    host = {name: t.cpu() for name, t in weights.items()}
    del weights
    path = folder / "model.safetensors"
    save_file(host, str(path))
    return path.stat().st_size
