"""The embedded default model: a small Qwen3 checkpoint made deterministically on first use, checked on every use.

Nothing is downloaded. ``default_model_dir()`` returns a cache folder
(``$NANOVERIFY_CACHE`` or ``~/.cache/nanoverify``, then ``default-qwen3-<VERSION>``)
holding config.json, model.safetensors (Hugging Face tensor names, separate
q/k/v and gate/up, untied lm_head) and a byte-level tokenizer.json, exactly
what a user's checkpoint holds, so the engine loads it through the same path.
The weights are a pure function of ``SEED`` and the shapes below: normal draws
scaled by 1/sqrt(fan_in) so activations keep their size through the layers
and greedy output varies with the prompt instead of settling on one token.
Bump ``VERSION`` whenever the recipe changes.

Invariants (spec/caches.md, DISK-4 to DISK-7): the folder returned is whole: each
file of ``FILES`` has the size and SHA-256 that the folder's manifest (written
last) records; they are checked on every call (about 13 MB hashed). A folder
missing, damaged, or without a manifest is made again whole: under an exclusive
lock beside it, in a scratch folder ``.making-<pid>-*`` renamed into place, the
damaged one renamed aside first; a process that waited on the lock uses what the
other made. Scratch of makers that are gone is removed then, never a live one's.
When the folder can be neither found whole nor made, ``DefaultModelUnavailable``
(an OSError) names the folder, the system's reason and NANOVERIFY_CACHE.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from kernels import disk_cache

VERSION = "v1"
# The files of the checkpoint, each recorded in the manifest, which is written last.
FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors")
MANIFEST = "nanoverify-manifest.json"
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


class DefaultModelUnavailable(OSError):
    """The default model is not whole in its cache folder and cannot be made there; the message names the folder,
    the system's reason, and NANOVERIFY_CACHE."""


def cache_root() -> Path:
    env = os.environ.get("NANOVERIFY_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "nanoverify"


def default_model_dir() -> Path:
    """The default checkpoint's folder, checked against its manifest and made whole first when missing or damaged."""
    target = cache_root() / f"default-qwen3-{VERSION}"
    if is_whole(target):
        return target
    try:
        _make_whole(target)
    except OSError as e:
        raise DefaultModelUnavailable(
            f"cannot make the default model in {target}: {_reason(e)}; set NANOVERIFY_CACHE to a writable folder"
        ) from None
    return target


def _reason(e: OSError) -> str:
    if isinstance(e, FileExistsError) and e.filename:
        return f"not a folder: {e.filename}"
    if e.strerror and e.filename:
        return f"{e.strerror}: {e.filename}"
    return str(e)


def is_whole(folder: Path) -> bool:
    """Whether ``folder`` holds each checkpoint file with the size and SHA-256 its manifest records."""
    try:
        listed = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        if not isinstance(listed, dict) or set(listed) != set(FILES):
            return False
        expected = {name: disk_cache.Checksum.from_json(record) for name, record in listed.items()}
    except (OSError, ValueError):  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        return False
    return all(disk_cache.file_checksum(folder / name, c.size) == c for name, c in expected.items())


def _make_whole(target: Path) -> None:
    """Holding the folder's lock: make the checkpoint in a scratch folder and swap it in (unless another process
    made it while this one waited), removing the scratch of makers that are gone."""
    root = target.parent
    with disk_cache.exclusive(root / f".{target.name}.lock"):
        if is_whole(target):
            return
        disk_cache.remove_stale_scratch(root)
        scratch = Path(tempfile.mkdtemp(prefix=disk_cache.scratch_prefix(), dir=root))
        try:
            write_checkpoint(scratch)
            write_manifest(scratch)
            _swap_in(scratch, target)
        finally:
            disk_cache.remove(scratch)


def _swap_in(made: Path, target: Path) -> None:
    """Rename ``made`` to ``target``; a damaged ``target`` is first renamed aside, then removed."""
    if not os.path.lexists(target):
        os.replace(made, target)
        return
    aside = Path(tempfile.mkdtemp(prefix=disk_cache.scratch_prefix("damaged"), dir=target.parent))
    os.replace(target, aside / target.name)
    try:
        os.replace(made, target)
    finally:
        disk_cache.remove(aside)


def write_manifest(folder: Path) -> None:
    """Record each checkpoint file's size and SHA-256 in the folder's manifest (written last)."""
    manifest: dict[str, dict[str, int | str]] = {}
    for name in FILES:
        checksum = disk_cache.file_checksum(folder / name)
        if checksum is None:
            raise FileNotFoundError(errno.ENOENT, "the checkpoint file was not written", str(folder / name))
        manifest[name] = checksum.to_json()
    disk_cache.write_json_atomically(folder / MANIFEST, manifest)


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
    (folder / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
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
    """Every file written by this process, not by a library, so a failed write is an OSError (DISK-7)."""
    from safetensors.torch import save

    (folder / "config.json").write_text(json.dumps(CONFIG, indent=2))
    write_tokenizer(folder)
    (folder / "model.safetensors").write_bytes(save(_weights()))
