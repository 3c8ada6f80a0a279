"""Tiny random Qwen3 / Qwen2 / Llama checkpoints made with transformers, and their reference outputs.

Each checkpoint (hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 256) is written
once per session with ``save_pretrained``. Weights are drawn with
initializer_range 0.2, and norm weights and biases are perturbed away from
their 1/0 initial values, so q/k norms and q/k/v biases matter and greedy
output varies with the prompt. ``hf_greedy`` memoises transformers'
``generate(do_sample=False)`` in float64 with eager attention, the oracle of
the token-exact tests.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import torch

from optimized import LLM

FAMILIES = ("qwen3", "qwen2", "llama")
VOCAB = 256


def _config(family: str) -> Any:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "initializer_range": 0.2,
        "eos_token_id": None,
        "bos_token_id": None,
        "pad_token_id": None,
        "tie_word_embeddings": family == "qwen2",  # one tied family exercises the tied path
    }
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    if family == "qwen2":
        return Qwen2Config(**common)
    return LlamaConfig(**common, attention_bias=True, mlp_bias=True)


def _model_class(family: str) -> Any:
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

    return {"qwen3": Qwen3ForCausalLM, "qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM}[family]


def make_checkpoint(family: str, folder: Path) -> Path:
    torch.manual_seed(1234)
    model = _model_class(family)(_config(family))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.save_pretrained(str(folder))
    return folder


_ROOT: list[Path] = []


def set_root(root: Path) -> None:
    """Where this session's checkpoints go; the first call wins (every test module calls it)."""
    if not _ROOT:
        _ROOT.append(root)


@cache
def checkpoint(family: str) -> Path:
    """The family's tiny checkpoint (made on first use under the session's root)."""
    return make_checkpoint(family, _ROOT[0] / family)


def with_config(family: str, name: str, **changes: Any) -> Path:
    """A copy of the family's checkpoint with config.json fields changed."""
    folder = _ROOT[0] / f"{family}-{name}"
    if not folder.exists():
        shutil.copytree(checkpoint(family), folder)
        for name in ("config.json", "generation_config.json"):
            cfg = json.loads((folder / name).read_text())
            cfg.update(changes)
            (folder / name).write_text(json.dumps(cfg))
    return folder


def make_llm(folder: Path | None = None, *, family: str = "qwen3", **overrides: Any) -> LLM:
    """An engine on ``folder`` (default: the family's tiny checkpoint) in float64, checked against the shadow,
    with 4-token blocks; ``overrides`` are LLM keyword arguments and win over these.
    A test module binds its own sizes once: ``make = partial(make_llm, num_kvcache_blocks=16)``."""
    args: dict[str, Any] = {"dtype": "float64", "check": True, "kvcache_block_size": 4, **overrides}
    return LLM(str(folder or checkpoint(family)), **args)


@cache
def hf_model(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float64, attn_implementation="eager")
    model.train(False)
    return model


def _eos_ids(model: Any) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


@cache
def _hf_one(folder: Path, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    model = hf_model(folder)
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
    return tuple(out[0, len(prompt) :].tolist())


def hf_greedy(folder: Path, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """transformers' greedy completions, one unpadded generate call per prompt (each stops at the config's eos,
    like the engine). Memoised at the longest max_tokens: greedy output of n tokens is a prefix of that of more."""
    longest = max(max_tokens)
    return [list(_hf_one(folder, tuple(p), longest)[:m]) for p, m in zip(prompts, max_tokens, strict=True)]


@contextmanager
def at_threads(count: int) -> Iterator[None]:
    """torch (and so the C kernels) on ``count`` threads, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def one_thread() -> AbstractContextManager[None]:
    """Run torch on one thread: these matrices are tiny, and on a shared 2-core machine OpenMP barriers
    between busy cores cost more than the arithmetic (measured: 0.2 s vs 7.8 s for the same engine run)."""
    return at_threads(1)
