"""What the engine reads from a checkpoint's config.json, validated once.

One decoder serves three families; they differ only in flags: Qwen3 normalises
q and k per head (``qk_norm``), Qwen2 adds biases to q/k/v, Llama may add
biases everywhere (``attention_bias``, ``mlp_bias``). Every field the model code
uses is resolved here, as transformers' config class of that family resolves
it (its defaults for absent fields included), so a config that parses builds a
model with no further surprises; anything the decoder cannot honour (other
activations, scaled or partial RoPE, sliding windows, quantized weights) is
refused with a ValueError naming the field. Every size is bounded (``LIMITS``, CKPT-3) so that no field alone asks
for an absurd allocation, and every eos id lies inside the vocabulary (CKPT-4); the files themselves are read as
hostile bytes (``optimized.models.checkpoint_files``, CKPT-1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from optimized.core.errors import is_strict_int
from optimized.models.checkpoint_files import read_json_object, regular_file

FAMILIES = ("qwen3", "qwen2", "llama")
# transformers' defaults, per family, for fields config.json leaves out (None: the query head count, resp.
# hidden_size // num_attention_heads). Qwen2/Qwen3 default to 32 KV heads, not to the query head count.
KV_HEADS_DEFAULT: dict[str, int | None] = {"qwen3": 32, "qwen2": 32, "llama": None}
HEAD_DIM_DEFAULT: dict[str, int | None] = {"qwen3": 128, "qwen2": None, "llama": None}
MAX_WINDOW_LAYERS_DEFAULT = 28  # Qwen2Config and Qwen3Config
SLIDING_WINDOW_DEFAULT = 4096  # Qwen2Config and Qwen3Config, when use_sliding_window is true and the key is absent
# Upper bounds on the sizes (CKPT-3), each far above any released model of these families (largest seen: vocabulary
# 262k, hidden 16k, MLP 53k, 126 layers, 128 heads, head_dim 256, context 10M); the memory check
# (optimized.models.loader) bounds their products.
LIMITS = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 18,
    "num_hidden_layers": 1 << 10,
    "num_attention_heads": 1 << 12,
    "num_key_value_heads": 1 << 12,
    "head_dim": 1 << 12,
    "max_position_embeddings": 1 << 24,
}


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]

    @property
    def eos(self) -> int:
        """The scheduler's single eos id (-1: none); further eos ids are engine stop tokens (ENG-15)."""
        return self.eos_token_ids[0] if self.eos_token_ids else -1


def _int(d: dict[str, Any], key: str, minimum: int = 1) -> int:
    value = d.get(key)
    maximum = LIMITS.get(key)
    if not is_strict_int(value) or value < minimum:
        raise ValueError(f"config.json: {key} must be an integer >= {minimum}, got {_short(value)}")
    if maximum is not None and value > maximum:
        raise ValueError(f"config.json: {key} must be at most {maximum}, got {_short(value)}")
    return value


def _short(value: object) -> str:
    """``repr(value)``, cut to 80 characters (a hostile config may hold a huge value)."""
    if is_strict_int(value) and value.bit_length() > 200:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _float(d: dict[str, Any], key: str, default: float) -> float:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"config.json: {key} must be a positive finite number, got {_short(value)}")
    return float(value)


def _flag(d: dict[str, Any], key: str) -> bool:
    """A boolean field: absent or null is false (transformers tests its truth); any other non-bool is refused."""
    value = d.get(key)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"config.json: {key} must be true or false, got {_short(value)}")
    return bool(value)


def _rope_params(d: dict[str, Any], key: str) -> dict[str, Any]:
    """``d[key]`` (``rope_parameters`` or ``rope_scaling``) as a flat, unscaled RoPE description; {} when absent."""
    params = d.get(key) or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"config.json: {key} must be one flat object (not per layer type), got {_short(params)}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ValueError(f"config.json: {key}.rope_type {_short(rope_type)} is not supported (only 'default')")
    return params


def _rope_theta(d: dict[str, Any]) -> float:
    """RoPE base as transformers resolves it: a present ``rope_scaling`` replaces ``rope_parameters``, and a base
    missing from the chosen object comes from the top-level ``rope_theta`` (the older form), else 10000. A scaled
    type in either object is refused, whichever of the two would be read."""
    parameters, scaling = _rope_params(d, "rope_parameters"), _rope_params(d, "rope_scaling")
    merged = {"rope_theta": d.get("rope_theta", 10000.0), **(scaling or parameters)}
    return _float(merged, "rope_theta", 10000.0)


def _refuse_partial_rotary(d: dict[str, Any]) -> None:
    """``partial_rotary_factor`` (top level, or in either RoPE object) other than 1 is refused. The field asks for
    RoPE over only the first fraction of each head, but transformers 5's default RoPE for these three families
    ignores it and rotates the whole head (only the scaled types, refused already, read it): the checkpoint's
    intent and transformers' output disagree, so neither reading can be served as exact."""
    places = {"partial_rotary_factor": d.get("partial_rotary_factor")}
    for key in ("rope_parameters", "rope_scaling"):
        places[f"{key}.partial_rotary_factor"] = (d.get(key) or {}).get("partial_rotary_factor")
    for name, value in places.items():
        if value is not None and (isinstance(value, bool) or value != 1):
            raise ValueError(
                f"config.json: {name} {_short(value)} is not supported (only 1.0: RoPE over the whole head)"
            )


def _refuse_sliding_window(d: dict[str, Any], family: str, num_layers: int) -> None:
    """Refuse any layer transformers would run with a sliding window (none is implemented). Qwen2/Qwen3 take an
    explicit ``layer_types``, else slide the layers from ``max_window_layers`` on when ``use_sliding_window`` is
    true and ``sliding_window`` is not null (absent means 4096); a window that reaches no layer is full attention
    there, and here. Llama has no sliding attention at all, so a Llama config asking for one is not a Llama
    transformers runs."""
    if family == "llama":
        if d.get("use_sliding_window"):
            raise ValueError("config.json: use_sliding_window is not supported")
        return
    layer_types = d.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise ValueError(f"config.json: layer_types must list num_hidden_layers ({num_layers}) entries")
        other = [t for t in layer_types if t != "full_attention"]
        if other:
            raise ValueError(f"config.json: layer_types other than 'full_attention' are not supported: {_short(other)}")
        return
    window = d.get("sliding_window", SLIDING_WINDOW_DEFAULT)  # an absent key is transformers' default, not null
    if d.get("use_sliding_window") and window is not None:
        first = d.get("max_window_layers", MAX_WINDOW_LAYERS_DEFAULT)
        if not is_strict_int(first) or first < num_layers:
            raise ValueError(
                f"config.json: use_sliding_window is not supported (sliding_window {_short(window)} "
                f"from layer max_window_layers={_short(first)} of num_hidden_layers={num_layers})"
            )


def _kv_heads(d: dict[str, Any], family: str, heads: int) -> int:
    value = d.get("num_key_value_heads", KV_HEADS_DEFAULT[family])
    # An explicit null means as many KV heads as query heads, in every family's config class.
    return _int({"num_key_value_heads": heads if value is None else value}, "num_key_value_heads")


def _head_dim(d: dict[str, Any], family: str, hidden: int, heads: int) -> int:
    if "head_dim" not in d or (d["head_dim"] is None and family == "llama"):  # LlamaConfig fills a null one
        value = HEAD_DIM_DEFAULT[family] or hidden // heads
    else:
        value = d["head_dim"]  # a null for Qwen2/Qwen3 fails in transformers; refused below
    head_dim = _int({"head_dim": value}, "head_dim", 2)
    if head_dim % 2:
        raise ValueError(f"config.json: head_dim must be even (RoPE rotates its two halves), got {head_dim}")
    return head_dim


def eos_ids(d: dict[str, Any], vocab_size: int, file: str = "config.json") -> tuple[int, ...]:
    """``eos_token_id`` (an id or a list of ids; null or absent: none), each inside the vocabulary (CKPT-4): an id
    the model can never emit would keep generation from ever stopping on it."""
    value = d.get("eos_token_id")
    ids = [] if value is None else value if isinstance(value, list) else [value]
    for t in ids:
        if not is_strict_int(t) or not 0 <= t < vocab_size:
            raise ValueError(
                f"{file}: eos_token_id must be token ids in [0, vocab_size={vocab_size}), got {_short(value)}"
            )
    return tuple(ids)


def _family(d: dict[str, Any]) -> str:
    family = d.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"config.json: model_type must be one of {FAMILIES}, got {_short(family)}")
    return str(family)


def parse_config(d: dict[str, Any]) -> ModelConfig:
    family = _family(d)
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act must be 'silu', got {_short(d.get('hidden_act'))}")
    if d.get("quantization_config") is not None:
        raise ValueError("config.json: quantization_config is not supported (only unquantized weights)")
    num_layers = _int(d, "num_hidden_layers")
    _refuse_sliding_window(d, family, num_layers)
    hidden = _int(d, "hidden_size")
    heads = _int(d, "num_attention_heads")
    kv_heads = _kv_heads(d, family, heads)
    if heads % kv_heads:
        raise ValueError(
            f"config.json: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    rope_theta = _rope_theta(d)  # first: it checks that both RoPE objects are flat objects
    _refuse_partial_rotary(d)
    attention_bias = _flag(d, "attention_bias")
    vocab_size = _int(d, "vocab_size")
    return ModelConfig(
        family=family,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=_int(d, "intermediate_size"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=_head_dim(d, family, hidden, heads),
        rms_norm_eps=_float(d, "rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        max_position_embeddings=_int(d, "max_position_embeddings"),
        tie_word_embeddings=_flag(d, "tie_word_embeddings"),
        qkv_bias=True if family == "qwen2" else attention_bias,
        o_bias=False if family == "qwen2" else attention_bias,
        mlp_bias=family == "llama" and _flag(d, "mlp_bias"),
        qk_norm=family == "qwen3",
        eos_token_ids=eos_ids(d, vocab_size),
    )


def load_config(model_dir: Path) -> ModelConfig:
    """config.json, with generation_config.json's eos ids appended (transformers' generate stops at those).

    Either file damaged (not a regular file, too large, not UTF-8 JSON, not an object) is a ValueError naming it;
    a field refusal names config.json and the field."""
    path = model_dir / "config.json"
    if not regular_file(path):
        raise ValueError(f"model: {model_dir} has no config.json")
    try:
        config = parse_config(read_json_object(path))
    except RecursionError:  # a deeply nested field, printed in a refusal
        raise ValueError(f"{path}: nested too deeply") from None
    gen_path = model_dir / "generation_config.json"
    if regular_file(gen_path):
        extra = eos_ids(read_json_object(gen_path), config.vocab_size, "generation_config.json")
        eos = config.eos_token_ids + tuple(t for t in extra if t not in config.eos_token_ids)
        config = replace(config, eos_token_ids=tuple(dict.fromkeys(eos)))
    return config
