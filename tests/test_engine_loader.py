"""The loader and the config parser refuse, by name, every checkpoint they cannot serve exactly (ENG-1).

Each case edits a private copy of the tiny Qwen3 checkpoint (tensors in its safetensors file, or fields of its
config.json) and builds an ``LLM`` on it: the ValueError must name the tensor or the field. The RoPE base cases
run the engine against transformers' greedy output on the same folder, with a base chosen so that it changes the
tokens, so a base that did not reach the model would be seen.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from optimized import LLM, SamplingParams
from optimized.models import parse_config
from optimized.models.loader import load_model
from tests.engine_fixtures import FAMILIES, checkpoint, hf_greedy

Tensors = dict[str, torch.Tensor]


pytestmark = pytest.mark.usefixtures("engine_env")


def copy_checkpoint(tmp_path: Path) -> Path:
    folder = tmp_path / "qwen3"
    shutil.copytree(checkpoint("qwen3"), folder)
    return folder


def edit_tensors(folder: Path, edit: Callable[[Tensors], Tensors | tuple[Tensors, Tensors]]) -> None:
    """Rewrite model.safetensors through ``edit``; a second dict returned goes to a second file."""
    path = folder / "model.safetensors"
    result = edit(load_file(str(path)))
    first, second = result if isinstance(result, tuple) else (result, None)
    save_file(first, str(path), metadata={"format": "pt"})
    if second is not None:
        save_file(second, str(folder / "model-00002.safetensors"), metadata={"format": "pt"})


def edit_config(folder: Path, **changes: Any) -> None:
    """config.json with ``changes`` applied; a value of None removes the field."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def build(folder: Path) -> LLM:
    return LLM(str(folder), dtype="float64", device="cpu", kvcache_block_size=4, num_kvcache_blocks=32)


K_PROJ = "model.layers.1.self_attn.k_proj.weight"
Q_NORM = "model.layers.0.self_attn.q_norm.weight"
UP_PROJ = "model.layers.0.mlp.up_proj.weight"


def _with(name: str, value: torch.Tensor) -> Callable[[Tensors], Tensors]:
    return lambda t: {**t, name: value}


def _without(name: str) -> Callable[[Tensors], Tensors]:
    return lambda t: {k: v for k, v in t.items() if k != name}


def _reshaped(name: str) -> Callable[[Tensors], Tensors]:
    return lambda t: {**t, name: t[name].t().contiguous()}


def _split_with_duplicate(name: str) -> Callable[[Tensors], tuple[Tensors, Tensors]]:
    """Half of the tensors in each file, ``name`` in both."""

    def edit(t: Tensors) -> tuple[Tensors, Tensors]:
        names = sorted(t)
        first = {k: t[k] for k in names[::2]}
        second = {k: t[k] for k in names[1::2]}
        first[name] = second[name] = t[name]
        return first, second

    return edit


# case -> (edit of the tensors, the name the message must hold)
BAD_TENSORS: dict[str, tuple[Callable[[Tensors], Tensors | tuple[Tensors, Tensors]], str]] = {
    "unknown module": (_with("model.layers.0.mlp.extra_proj.weight", torch.zeros(4, 4)), "mlp.extra_proj"),
    "layer beyond the config": (_with("model.layers.2.mlp.down_proj.weight", torch.zeros(64, 128)), "layers.2."),
    "bias the model lacks": (_with("model.layers.0.self_attn.o_proj.bias", torch.zeros(64)), "o_proj.bias"),
    "outside the layers": (_with("model.extra.weight", torch.zeros(4)), "model.extra.weight"),
    "missing packed shard": (_without(K_PROJ), K_PROJ),
    "missing norm": (_without(Q_NORM), Q_NORM),
    "missing lm_head (untied)": (_without("lm_head.weight"), "lm_head.weight"),
    "mis-shaped packed shard": (_reshaped(UP_PROJ), UP_PROJ),
    "mis-shaped embedding": (_reshaped("model.embed_tokens.weight"), "model.embed_tokens.weight"),
    "duplicated across files": (_split_with_duplicate(K_PROJ), K_PROJ),
}


@pytest.mark.clause("ENG-1")
@pytest.mark.parametrize("case", sorted(BAD_TENSORS))
def test_bad_tensor_is_refused_by_name(case: str, tmp_path: Path) -> None:
    """ENG-1: an unknown, missing, duplicated or mis-shaped checkpoint tensor is a ValueError naming it (the
    checkpoint's own name, not the packed parameter it lands in)."""
    edit, name = BAD_TENSORS[case]
    folder = copy_checkpoint(tmp_path)
    edit_tensors(folder, edit)
    with pytest.raises(ValueError, match=re.escape(name)):
        build(folder)


@pytest.mark.clause("ENG-1")
@pytest.mark.parametrize("family", FAMILIES)
def test_every_missing_tensor_is_named(family: str, tmp_path: Path) -> None:
    """ENG-1: whichever single tensor a checkpoint lacks (a packed shard, a norm, a bias, the embedding...), the
    refusal names that tensor as the checkpoint spells it."""
    source = checkpoint(family) / "model.safetensors"
    names = sorted(load_file(str(source)))
    assert len(names) > 20
    for name in names:
        folder = tmp_path / name
        folder.mkdir()
        shutil.copy(checkpoint(family) / "config.json", folder)
        save_file({k: v for k, v in load_file(str(source)).items() if k != name}, str(folder / "model.safetensors"))
        with pytest.raises(ValueError, match=rf"lacks tensors for: {re.escape(name)}$"):
            load_model(folder, torch.float64, torch.device("cpu"))


@pytest.mark.clause("ENG-1")
def test_untouched_copy_and_split_files_load(tmp_path: Path) -> None:
    """ENG-1: the refusals above come from the edits: the same copy, and the same tensors split over two files
    without a duplicate, load and serve."""
    folder = copy_checkpoint(tmp_path)
    build(folder)

    def split(t: Tensors) -> tuple[Tensors, Tensors]:
        names = sorted(t)
        return {k: t[k] for k in names[::2]}, {k: t[k] for k in names[1::2]}

    edit_tensors(folder, split)
    assert len(list(folder.glob("*.safetensors"))) == 2
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    out = build(folder).generate([prompt], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert out[0].token_ids == hf_greedy(checkpoint("qwen3"), [prompt], [4])[0]


LINEAR = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}

# case -> (config.json changes, the field the message must name)
BAD_CONFIGS: dict[str, tuple[dict[str, Any], str]] = {
    "gelu": ({"hidden_act": "gelu"}, "hidden_act"),
    "linear rope_parameters": ({"rope_parameters": LINEAR}, "rope_type"),
    "yarn rope_parameters": (
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5000.0}},
        "rope_type",
    ),
    "older rope_scaling type": ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope"),
    # transformers reads rope_scaling before rope_parameters: the scaled type wins there, so it must be refused here.
    "rope_scaling beside default rope_parameters": ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope"),
    # Per-layer-type RoPE (keyed by layer_types) is not one RoPE; the scaled type inside must not slip through.
    "per layer type rope_parameters": ({"rope_parameters": {"full_attention": LINEAR}}, "rope_parameters"),
    # The saved config lists layer_types, which transformers reads before use_sliding_window: remove it, so the
    # window reaches layer 1 (max_window_layers=1 of 2 layers).
    "sliding window": (
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "layer_types": None},
        "use_sliding_window",
    ),
    # An absent sliding_window is not a null one: transformers then takes its default window, 4096.
    "sliding window of the default size": (
        {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 1, "layer_types": None},
        "use_sliding_window",
    ),
    "sliding layer in layer_types": (
        {"use_sliding_window": True, "sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"]},
        "layer_types",
    ),
    "layer_types of the wrong length": ({"layer_types": ["full_attention"]}, "layer_types"),
    "partial rotary (top level)": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    "partial rotary in rope_parameters": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5}},
        "rope_parameters.partial_rotary_factor",
    ),
    "partial rotary in rope_scaling": (
        {"rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.25}},
        "rope_scaling.partial_rotary_factor",
    ),
    "quantized weights": ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    "odd head_dim": ({"head_dim": 15}, "head_dim"),
}


@pytest.mark.clause("ENG-1", "ENG-7")
@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_unsupported_config_is_refused_by_name(case: str, tmp_path: Path) -> None:
    """ENG-1, ENG-7: activations other than SiLU, scaled or partial RoPE, sliding windows (however the config
    reaches a layer with one), quantized weights and an odd head_dim are refused by name."""
    changes, field = BAD_CONFIGS[case]
    folder = copy_checkpoint(tmp_path)
    edit_config(folder, **changes)
    with pytest.raises(ValueError, match=re.escape(field)):
        build(folder)


PROMPTS = [[7, 200, 13, 99, 42, 5, 180, 61, 33, 250, 17, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [128, 64, 32, 16]]
MAX_TOKENS = [10, 10, 10]


def greedy(folder: Path) -> list[list[int]]:
    outs = build(folder).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    return [o.token_ids for o in outs]


FULL_ROTARY = {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 1.0}

# case -> config.json changes that leave transformers' model as it was. The window (4) is shorter than the prompts
# plus outputs, so a layer that slid would change the tokens.
NO_OPS: dict[str, dict[str, Any]] = {
    "a window the saved layer_types keep off": {"use_sliding_window": True, "sliding_window": 4},
    "a window from layer max_window_layers=2 of 2": {
        "use_sliding_window": True,
        "sliding_window": 4,
        "max_window_layers": 2,
        "layer_types": None,
    },
    "partial_rotary_factor 1 everywhere": {"partial_rotary_factor": 1, "rope_parameters": FULL_ROTARY},
}


@pytest.mark.clause("ENG-7")
@pytest.mark.parametrize("case", sorted(NO_OPS))
def test_refusals_stop_where_transformers_changes_nothing(case: str, tmp_path: Path) -> None:
    """ENG-7: the sliding-window and partial-RoPE refusals follow transformers' reading: a window that reaches
    no layer, or a rotary factor of 1, is served, with transformers' own greedy output on the edited folder."""
    folder = copy_checkpoint(tmp_path)
    edit_config(folder, **NO_OPS[case])
    expected = hf_greedy(folder, PROMPTS, MAX_TOKENS)
    assert expected == hf_greedy(checkpoint("qwen3"), PROMPTS, MAX_TOKENS)
    assert greedy(folder) == expected


@pytest.mark.clause("ENG-7")
def test_rms_norm_eps_reaches_every_norm(tmp_path: Path) -> None:
    """ENG-7: rms_norm_eps is honoured: a large one changes transformers' tokens, and the engine's equal them (an
    eps missing from any norm, q/k norms included, would show)."""
    folder = copy_checkpoint(tmp_path)
    edit_config(folder, rms_norm_eps=0.5)
    expected = hf_greedy(folder, PROMPTS, MAX_TOKENS)
    assert expected != hf_greedy(checkpoint("qwen3"), PROMPTS, MAX_TOKENS)
    assert greedy(folder) == expected


MINIMAL = {
    "vocab_size": 256,
    "hidden_size": 256,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 32,
    "max_position_embeddings": 256,
}


@pytest.mark.clause("ENG-7")
@pytest.mark.parametrize("family", FAMILIES)
def test_absent_and_null_fields_resolve_as_transformers_config(family: str) -> None:
    """ENG-7: a field config.json leaves out, or sets to null, takes the value transformers' config class of
    the family gives it (Qwen2/Qwen3 default to 32 KV heads, Qwen3 to head_dim 128); the head_dim is the one
    transformers' attention reads (``getattr(config, "head_dim", hidden // heads)``)."""
    from transformers import CONFIG_MAPPING

    variants: list[dict[str, Any]] = [{}, {"num_key_value_heads": None}]
    if family == "llama":
        variants.append({"head_dim": None})
    for extra in variants:
        d = {"model_type": family, **MINIMAL, **extra}
        ours = parse_config(d)
        theirs = CONFIG_MAPPING[family].from_dict(d)
        head_dim = getattr(theirs, "head_dim", theirs.hidden_size // theirs.num_attention_heads)
        assert (ours.num_kv_heads, ours.head_dim, ours.rms_norm_eps, ours.tie_word_embeddings) == (
            theirs.num_key_value_heads,
            head_dim,
            theirs.rms_norm_eps,
            theirs.tie_word_embeddings,
        ), extra
        assert ours.rope_theta == theirs.rope_parameters["rope_theta"]


# (family, config.json changes, the field the message must name): refusals where the families differ.
FAMILY_REFUSALS = [
    ("llama", {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
    ("qwen3", {"head_dim": None}, "head_dim"),
    ("qwen2", {"head_dim": None}, "head_dim"),
    ("qwen2", {"num_key_value_heads": 3}, "num_key_value_heads"),
]


@pytest.mark.clause("ENG-7")
@pytest.mark.parametrize(("family", "changes", "field"), FAMILY_REFUSALS)
def test_family_specific_config_refusals(family: str, changes: dict[str, Any], field: str) -> None:
    """ENG-7: Llama has no sliding attention, so any use_sliding_window is refused; a null head_dim, which
    transformers' Qwen2 and Qwen3 cannot run, is refused by name; so are KV heads that do not divide the heads."""
    d = {**json.loads((checkpoint(family) / "config.json").read_text()), **changes}
    with pytest.raises(ValueError, match=re.escape(field)):
        parse_config(d)


# case -> (config.json changes, the RoPE base transformers uses for them)
ROPE_BASES: dict[str, tuple[dict[str, Any], float]] = {
    "top-level rope_theta only": ({"rope_parameters": None, "rope_theta": 7.0}, 7.0),
    # transformers takes a present rope_scaling over rope_parameters, completed from the top-level rope_theta.
    "default rope_scaling over rope_parameters": ({"rope_scaling": {"rope_type": "default"}, "rope_theta": 7.0}, 7.0),
}


@pytest.mark.clause("ENG-1")
@pytest.mark.parametrize("case", sorted(ROPE_BASES))
def test_rope_base_reaches_the_model_as_transformers_reads_it(case: str, tmp_path: Path) -> None:
    """ENG-1: RoPE's base comes from ``rope_parameters.rope_theta`` or the older top-level ``rope_theta``, as
    transformers resolves them; greedy output equals transformers' on the same config, and differs from the
    checkpoint's own base (5000), so the base is seen."""
    changes, theta = ROPE_BASES[case]
    folder = copy_checkpoint(tmp_path)
    edit_config(folder, **changes)
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(str(folder)).rope_parameters["rope_theta"] == theta
    llm = build(folder)
    assert llm.engine.runner.model.config.rope_theta == theta
    expected = hf_greedy(folder, PROMPTS, MAX_TOKENS)
    assert greedy(folder) == expected
    assert expected != hf_greedy(checkpoint("qwen3"), PROMPTS, MAX_TOKENS)
