"""Loading a Hugging Face checkpoint folder (config.json + *.safetensors) into ``CausalLM``.

Every parameter of the model is filled exactly once: a tensor the model does
not know, a missing one, or a shape that disagrees is a ValueError naming the
tensor, so a half-loaded model never runs. The checkpoint's separate q/k/v and
gate/up matrices land in row ranges of the packed ``qkv_proj`` / ``gate_up_proj``;
with tied embeddings ``lm_head`` is the embedding matrix (a stored
``lm_head.weight`` is then ignored). Tensors are cast to the engine's dtype as
they are read.

Nothing is allocated before the checkpoint is known to fit (CKPT-5): the safetensors headers alone (names,
dtypes, shapes) must hold every tensor the config requires, each of a floating dtype and of the expected shape,
and the model the config describes (weights plus the rotary table) must fit in the device's memory. Each weight
is checked finite in the engine's dtype as it lands (CKPT-6). Any file the safetensors library still cannot read
is a ValueError naming it (CKPT-2).

A tensor-parallel rank (spec/parallel.md, TP-4) reads only its own piece of each split tensor from the file
(``safe_open(...).get_slice``), so no rank ever holds the whole model; the checks above stay on the whole
checkpoint's headers.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from optimized.models.checkpoint_files import FLOAT_DTYPES, TensorInfo, read_safetensors_header, regular_file
from optimized.models.config import ModelConfig, load_config
from optimized.models.decoder import CausalLM, TensorParallel
from optimized.models.sharding import Shard, source_slice

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


def _copy(param: torch.Tensor, tensor: torch.Tensor, rows: tuple[int, int] | None, name: str) -> torch.Tensor:
    """``tensor`` copied into ``param`` (or its rows), cast to its dtype; the filled view."""
    dest = param if rows is None else param[rows[0] : rows[1]]
    if dest.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    if not tensor.is_floating_point():
        raise ValueError(f"checkpoint tensor {name!r} has dtype {tensor.dtype}; weights must be floating point")
    return dest.copy_(tensor)


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
    c = model.local_config
    pieces: dict[Piece, str] = {}
    for pname, _ in model.named_parameters():  # tied lm_head is listed once, as embed_tokens
        kind_free = pname.rpartition(".")[0]
        shards = [(m, packed, s) for m, (packed, s) in _PACKED.items() if kind_free.endswith(packed)]
        for module, packed, shard in shards:
            pieces[(pname, _shard_rows(c, packed, shard))] = _checkpoint_name(pname, module)
        if not shards:
            pieces[(pname, None)] = _checkpoint_name(pname)
    return pieces


def required_tensors(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the config requires, by the checkpoint's name, with its shape."""
    q, kv, d = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.head_dim
    h, i = c.hidden_size, c.intermediate_size
    layer: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }
    if c.qkv_bias:
        layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
    if c.o_bias:
        layer["self_attn.o_proj.bias"] = (h,)
    if c.qk_norm:
        layer |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
    if c.mlp_bias:
        layer |= {"mlp.gate_proj.bias": (i,), "mlp.up_proj.bias": (i,), "mlp.down_proj.bias": (h,)}
    tensors = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        tensors["lm_head.weight"] = (c.vocab_size, h)
    for n in range(c.num_layers):
        tensors |= {f"model.layers.{n}.{name}": shape for name, shape in layer.items()}
    return tensors


def _bytes_needed(c: ModelConfig, dtype: torch.dtype) -> int:
    """The model's weights in ``dtype``, plus the rotary table at the full context (its float32 work included)."""
    outside = sum(map(math.prod, required_tensors(replace(c, num_layers=0)).values()))
    per_layer = sum(map(math.prod, required_tensors(replace(c, num_layers=1)).values())) - outside
    size = dtype.itemsize
    rotary = c.max_position_embeddings * c.head_dim * (size + 8)
    return (outside + c.num_layers * per_layer) * size + rotary


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(c: ModelConfig, dtype: torch.dtype, device: torch.device, shard: Shard | None = None) -> None:
    """Refuse, naming the sizes, a config whose model (with ``shard``: that rank's piece of it, TP-4) would not fit
    in the device's memory (CKPT-5)."""
    held = c if shard is None else shard.local_config(c)
    needed, available = _bytes_needed(held, dtype), _device_memory(device)
    if needed > available:
        piece = "" if shard is None else f" for rank {shard.rank}'s piece of {shard.size}"
        raise ValueError(
            f"config.json: vocab_size={c.vocab_size}, hidden_size={c.hidden_size}, "
            f"intermediate_size={c.intermediate_size}, num_hidden_layers={c.num_layers}, "
            f"num_attention_heads={c.num_heads}, num_key_value_heads={c.num_kv_heads}, head_dim={c.head_dim}, "
            f"max_position_embeddings={c.max_position_embeddings} need {needed} bytes in {dtype} "
            f"(weights and rotary table){piece}, more than this machine's {available}"
        )


def _safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    for path in files:
        if not regular_file(path):
            raise ValueError(f"{path}: no such file")
    if not files:
        raise ValueError(f"model: {model_dir} has no *.safetensors files")
    return files


def _check_entry(c: ModelConfig, required: dict[str, tuple[int, ...]], path: Path, name: str, info: TensorInfo) -> None:
    if name not in required:
        raise ValueError(f"checkpoint tensor {name!r} in {path} is not part of a {c.family} model")
    if info.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"checkpoint tensor {name!r} in {path} has dtype {info.dtype}; weights must be floating point "
            f"({', '.join(FLOAT_DTYPES)})"
        )
    if info.shape != required[name]:
        raise ValueError(f"checkpoint tensor {name!r} in {path} has shape {info.shape}, expected {required[name]}")


def _layers_held(names: set[str]) -> int:
    return 1 + max((int(m.group(1)) for m in map(_LAYER.match, names) if m is not None), default=-1)


def check_headers(c: ModelConfig, model_dir: Path, files: list[Path]) -> None:
    """The headers hold every required tensor once, floating and of the expected shape, and nothing else."""
    required = required_tensors(c)
    seen: set[str] = set()
    for path in files:
        for name, info in read_safetensors_header(path).items():
            if _IGNORED.match(name) or (c.tie_word_embeddings and name == "lm_head.weight"):
                continue
            _check_entry(c, required, path, name, info)
            if name in seen:
                raise ValueError(f"checkpoint tensor {name!r} appears twice")
            seen.add(name)
    held = _layers_held(seen)
    if held < c.num_layers:
        raise ValueError(f"config.json: num_hidden_layers={c.num_layers}, but {model_dir} holds {held} layers")
    missing = sorted(set(required) - seen)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensors for: {', '.join(missing[:8])}")


_FINITE_CHUNK = 1 << 24  # elements per isfinite pass: its bool temporary stays at 16 MB, whatever the tensor


def _all_finite(t: torch.Tensor) -> bool:
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[a : a + _FINITE_CHUNK]).all()) for a in range(0, flat.numel(), _FINITE_CHUNK))


def _read(f: Any, name: str, model: CausalLM) -> torch.Tensor:
    """Checkpoint tensor ``name``, or only this rank's piece of it under tensor parallelism (TP-4)."""
    if model.tp is None:
        return f.get_tensor(name)  # type: ignore[no-any-return]
    part = source_slice(model.tp.shard, model.config, name)
    if part is None:
        return f.get_tensor(name)  # type: ignore[no-any-return]
    dim, a, b = part
    piece = f.get_slice(name)
    return piece[a:b] if dim == 0 else piece[:, a:b]  # type: ignore[no-any-return]


def _vocab_rows(model: CausalLM, name: str) -> tuple[int, int] | None:
    """The rows a rank's padded vocabulary piece fills from ``name`` (None: all of them, or not a vocabulary)."""
    if model.tp is None or name not in ("model.embed_tokens.weight", "lm_head.weight"):
        return None
    start, end = model.tp.shard.vocab_range(model.config)
    return (0, end - start)


def _zero_padding(model: CausalLM) -> None:
    """A padded vocabulary piece's rows past the checkpoint's: zeros, never the allocation's garbage."""
    rows = _vocab_rows(model, "lm_head.weight")
    if rows is not None:
        model.embed_tokens.weight[rows[1] :].zero_()
        model.lm_head.weight[rows[1] :].zero_()


def _load_file(model: CausalLM, path: Path, expected: dict[Piece, str], loaded: set[Piece]) -> None:
    """Each tensor of ``path`` into its parameter piece, checked finite in the model's dtype there (CKPT-6)."""
    params = dict(model.named_parameters())
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            target = _target(model.local_config, name)
            if target is None:
                continue
            if target not in expected:
                raise ValueError(f"checkpoint tensor {name!r} is not part of a {model.config.family} model")
            if target in loaded:
                raise ValueError(f"checkpoint tensor {name!r} appears twice")
            dest = _copy(params[target[0]].data, _read(f, name, model), target[1] or _vocab_rows(model, name), name)
            if not _all_finite(dest):
                raise ValueError(f"checkpoint tensor {name!r} in {path} holds non-finite values (NaN or Inf) "
                                 f"as {dest.dtype}")
            loaded.add(target)


def load_weights(model: CausalLM, model_dir: Path, files: list[Path] | None = None) -> None:
    """Fill every parameter from ``files`` (default: the folder's *.safetensors); a file the safetensors library
    cannot read is a ValueError naming it."""
    files = _safetensors_files(model_dir) if files is None else files
    expected = _expected_pieces(model)
    loaded: set[Piece] = set()
    for path in files:
        try:
            _load_file(model, path, expected, loaded)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    missing = sorted(name for piece, name in expected.items() if piece not in loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensors for: {', '.join(missing[:8])}")
    _zero_padding(model)


def check_checkpoint(
    c: ModelConfig, model_dir: Path, dtype: torch.dtype, device: torch.device, shard: Shard | None = None
) -> list[Path]:
    """What is refused before any weight is read: the model (or ``shard``'s piece) not fitting the device (CKPT-5),
    headers that do not hold the model (CKPT-5); the weights files."""
    check_fits(c, dtype, device, shard)
    files = _safetensors_files(model_dir)
    check_headers(c, model_dir, files)
    return files


def load_model(
    model_dir: Path, dtype: torch.dtype, device: torch.device, tp: TensorParallel | None = None
) -> CausalLM:
    """Config, then weights, then the model (this rank's piece under ``tp``) in ``dtype`` on ``device``, in
    inference mode."""
    config = load_config(model_dir)
    files = check_checkpoint(config, model_dir, dtype, device, None if tp is None else tp.shard)
    # Built on the meta device and materialised uninitialised: the loader fills every parameter.
    with torch.device("meta"):
        model = CausalLM(config, tp).to(dtype)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.requires_grad_(False)
    with torch.no_grad():
        load_weights(model, model_dir, files)
    return model.eval()
