"""Loading a Hugging Face checkpoint folder (config.json + *.safetensors) into ``CausalLM``.

Every parameter of the model is filled exactly once: a tensor the model does
not know, a missing one, or a shape that disagrees is a ValueError naming the
tensor, so a half-loaded model never runs. The checkpoint's separate q/k/v and
gate/up matrices land in row ranges of the packed ``qkv_proj`` / ``gate_up_proj``;
with tied embeddings ``lm_head`` is the embedding matrix (a stored
``lm_head.weight`` is then ignored). Tensors are cast to the engine's dtype as
they are read.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from optimized.models.config import ModelConfig, load_config
from optimized.models.decoder import CausalLM

# Checkpoint name suffix -> (packed parameter suffix, shard index) within a layer.
_PACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
# Norm weights are bare Parameters here, ``<name>.weight`` in the checkpoint.
_BARE = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def _shard_rows(c: ModelConfig, packed: str, shard: int) -> tuple[int, int]:
    if packed.endswith("qkv_proj"):
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
    i = c.intermediate_size
    return (shard * i, (shard + 1) * i)


def _target(c: ModelConfig, name: str) -> tuple[str, tuple[int, int] | None] | None:
    """(parameter name, packed row range or None) for a checkpoint tensor; None to skip it."""
    if _IGNORED.match(name) or (c.tie_word_embeddings and name == "lm_head.weight"):
        return None
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if name == "model.norm.weight":
        return "norm", None
    if name == "lm_head.weight":
        return name, None
    m = _LAYER.match(name)
    if m is None:
        raise ValueError(f"checkpoint tensor {name!r} is not part of a {c.family} model")
    layer, module, kind = m.groups()
    prefix = f"layers.{layer}."
    if module in _PACKED:
        packed, shard = _PACKED[module]
        return f"{prefix}{packed}.{kind}", _shard_rows(c, packed, shard)
    if module in _BARE and kind == "weight":
        return prefix + module, None
    return f"{prefix}{module}.{kind}", None


def _copy(param: torch.Tensor, tensor: torch.Tensor, rows: tuple[int, int] | None, name: str) -> None:
    dest = param if rows is None else param[rows[0] : rows[1]]
    if dest.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(tensor)


Piece = tuple[str, tuple[int, int] | None]  # a parameter, or a packed parameter's row range


def _checkpoint_name(pname: str, packed_module: str | None = None) -> str:
    """The checkpoint's name for parameter ``pname`` (``packed_module``: the shard's own module, e.g. k_proj)."""
    if pname == "lm_head.weight":
        return pname
    if pname == "norm":
        return "model.norm.weight"
    head, _, kind = pname.rpartition(".")
    if packed_module is not None:
        layer_prefix = head.rsplit(".", 2)[0]  # "layers.N"
        return f"model.{layer_prefix}.{packed_module}.{kind}"
    if pname.endswith(_BARE):
        return f"model.{pname}.weight"
    return f"model.{pname}"


def _expected_pieces(model: CausalLM) -> dict[Piece, str]:
    """Every piece the checkpoint must fill, with the checkpoint tensor that fills it (named in refusals)."""
    c = model.config
    pieces: dict[Piece, str] = {}
    for pname, _ in model.named_parameters():  # tied lm_head is listed once, as embed_tokens
        kind_free = pname.rpartition(".")[0]
        shards = [(m, packed, s) for m, (packed, s) in _PACKED.items() if kind_free.endswith(packed)]
        for module, packed, shard in shards:
            pieces[(pname, _shard_rows(c, packed, shard))] = _checkpoint_name(pname, module)
        if not shards:
            pieces[(pname, None)] = _checkpoint_name(pname)
    return pieces


def load_weights(model: CausalLM, model_dir: Path) -> None:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: {model_dir} has no *.safetensors files")
    params = dict(model.named_parameters())
    expected = _expected_pieces(model)
    loaded: set[Piece] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                target = _target(model.config, name)
                if target is None:
                    continue
                if target not in expected:
                    raise ValueError(f"checkpoint tensor {name!r} is not part of a {model.config.family} model")
                if target in loaded:
                    raise ValueError(f"checkpoint tensor {name!r} appears twice")
                _copy(params[target[0]].data, f.get_tensor(name), target[1], name)
                loaded.add(target)
    missing = sorted(name for piece, name in expected.items() if piece not in loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensors for: {', '.join(missing[:8])}")


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Config, then weights, then the model in ``dtype`` on ``device``, in inference mode."""
    config = load_config(model_dir)
    # Built on the meta device and materialised uninitialised: the loader fills every parameter.
    with torch.device("meta"):
        model = CausalLM(config).to(dtype)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.requires_grad_(False)
    with torch.no_grad():
        load_weights(model, model_dir)
    return model.eval()
