"""The embedded default model: a small Qwen3 checkpoint made deterministically on first use.

Nothing is downloaded. ``default_model_dir()`` returns a cache folder
(``$NANOVERIFY_CACHE`` or ``~/.cache/nanoverify``, then ``default-qwen3-<VERSION>``)
holding config.json, model.safetensors (Hugging Face tensor names, separate
q/k/v and gate/up, untied lm_head) and a byte-level tokenizer.json, exactly
what a user's checkpoint holds, so the engine loads it through the same path.
The weights are a pure function of ``SEED`` and the shapes below: normal draws
scaled by 1/sqrt(fan_in) so activations keep their size through the layers
and greedy output varies with the prompt instead of settling on one token. The
folder is written beside its final name and renamed into place, so a reader
never sees half a checkpoint. Bump ``VERSION`` whenever the recipe changes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

VERSION = "v1"
SEED = 20240603
EOS = "<|endoftext|>"
CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 257,  # 256 bytes + EOS
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": 256,
    "pad_token_id": 256,
    "torch_dtype": "float32",
}


def cache_root() -> Path:
    env = os.environ.get("NANOVERIFY_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "nanoverify"


def default_model_dir() -> Path:
    """The default checkpoint's folder, made on first use."""
    target = cache_root() / f"default-qwen3-{VERSION}"
    if not (target / "model.safetensors").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".making-", dir=target.parent))
        try:
            write_checkpoint(tmp)
            if target.exists() and not (target / "model.safetensors").is_file():
                shutil.rmtree(target)  # a damaged copy: replaced whole
            try:
                os.replace(tmp, target)
            except OSError:  # another process made it first
                if not (target / "model.safetensors").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _byte_chars() -> list[str]:
    """A printable stand-in character for each byte value (the usual byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tokenizer(folder: Path) -> None:
    """Byte-level tokenizer: token id b is byte b, no merges, id 256 is EOS."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS, special=True)])
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _weights() -> dict[str, Any]:
    import torch

    c = CONFIG
    g = torch.Generator().manual_seed(SEED)
    hidden, inter, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        w: torch.Tensor = torch.randn(out_f, in_f, generator=g) / in_f**0.5
        return w

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(c["vocab_size"], hidden, generator=g)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj": (q, hidden),
            "self_attn.k_proj": (kv, hidden),
            "self_attn.v_proj": (kv, hidden),
            "self_attn.o_proj": (hidden, q),
            "mlp.gate_proj": (inter, hidden),
            "mlp.up_proj": (inter, hidden),
            "mlp.down_proj": (hidden, inter),
        }
        for name, (o, n) in shapes.items():
            w[f"{p}{name}.weight"] = linear(o, n)
        for norm, size in (("input_layernorm", hidden), ("post_attention_layernorm", hidden)):
            w[f"{p}{norm}.weight"] = torch.ones(size)
        for norm in ("self_attn.q_norm", "self_attn.k_norm"):
            w[f"{p}{norm}.weight"] = torch.ones(d)
    w["model.norm.weight"] = torch.ones(hidden)
    w["lm_head.weight"] = linear(c["vocab_size"], hidden)
    return w


def write_checkpoint(folder: Path) -> None:
    from safetensors.torch import save_file

    (folder / "config.json").write_text(json.dumps(CONFIG, indent=2))
    write_tokenizer(folder)
    save_file(_weights(), str(folder / "model.safetensors"))
