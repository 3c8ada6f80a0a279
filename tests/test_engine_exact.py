"""Greedy output of the engine equals transformers' token for token (float64), under every scheduling regime."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from optimized import LLM, SamplingParams
from tests.engine_fixtures import FAMILIES, VOCAB, checkpoint, hf_greedy, with_config

pytestmark = pytest.mark.usefixtures("engine_env")


def prompts_with_shared_prefixes(seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(VOCAB) for _ in range(20)]
    shared = [
        base[: rng.randrange(8, 21)] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))] for _ in range(6)
    ]
    alone = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))] for _ in range(2)]
    return [shared[0], alone[0], *shared[1:], alone[1]]


PROMPTS = prompts_with_shared_prefixes()
MAX_TOKENS = [12 + 3 * (i % 4) for i in range(len(PROMPTS))]

# name -> (LLM keyword arguments, the engine stat that must be non-zero)
SETTINGS: dict[str, tuple[dict[str, Any], str]] = {
    "plain-bs16": ({"kvcache_block_size": 16, "num_kvcache_blocks": 64}, "decode_steps"),
    "prefix-bs4": ({"kvcache_block_size": 4, "num_kvcache_blocks": 128, "max_num_seqs": 3}, "prefix_cache_hit_tokens"),
    "chunked-bs8": (
        {"kvcache_block_size": 8, "num_kvcache_blocks": 64, "max_num_batched_tokens": 7},
        "chunked_prefills",
    ),
    "preempt-bs2": ({"kvcache_block_size": 2, "num_kvcache_blocks": 30}, "preemptions"),
}


def run_engine(folder: Path, kwargs: dict[str, Any], params: list[SamplingParams]) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(folder), dtype="float64", device="cpu", check=True, **kwargs)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return llm, [o.token_ids for o in outs]


@pytest.mark.clause("ENG-1", "ENG-2", "ENG-3", "ENG-4", "ENG-5", "ENG-6", "ENG-16")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_matches_transformers(family: str, setting: str) -> None:
    """ENG-1, ENG-2, ENG-3, ENG-4, ENG-5, ENG-6, ENG-16: float64 greedy output is transformers' for Qwen3, Qwen2
    and Llama, with prefix-cache hits, chunked prefill and preemption actually happening, check mode on."""
    folder = checkpoint(family)
    kwargs, stat = SETTINGS[setting]
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in MAX_TOKENS]
    llm, got = run_engine(folder, kwargs, params)
    expected = hf_greedy(folder, PROMPTS, MAX_TOKENS)
    assert got == expected
    stats = llm.engine.stats
    assert getattr(stats, stat) > 0, f"{setting} did not exercise {stat}: {stats}"
    assert stats.compared_steps == stats.steps > 0
    # The outputs are not degenerate: they vary within and across requests.
    assert len({t for out in got for t in out}) > 20
    assert len({tuple(out) for out in got}) == len(got)


@pytest.mark.clause("ENG-15", "ENG-16")
def test_eos_from_config_stops_like_transformers() -> None:
    """ENG-15, ENG-16: the config's eos (first id: the scheduler's; further ids: engine stop tokens) ends a request
    with finish_reason "stop", where transformers stops too."""
    folder = checkpoint("qwen3")
    plain = hf_greedy(folder, PROMPTS, [16] * len(PROMPTS))[0]
    first, second = plain[5], plain[9]
    for eos in (first, [VOCAB - 1, second]):
        eos_folder = with_config("qwen3", f"eos{eos}".replace(" ", ""), eos_token_id=eos)
        llm = LLM(str(eos_folder), dtype="float64", check=True, kvcache_block_size=4, num_kvcache_blocks=64)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
        expected = hf_greedy(eos_folder, PROMPTS, [16] * len(PROMPTS))
        assert [o.token_ids for o in outs] == expected
        stop = first if isinstance(eos, int) else second
        assert outs[0].token_ids == plain[: plain.index(stop) + 1]
        assert outs[0].finish_reason == "stop"
        for o in outs:
            assert o.finish_reason == ("stop" if o.token_ids[-1] in (stop,) else "length")
        ignored = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), False)
        assert ignored[0].token_ids == plain and ignored[0].finish_reason == "length"


@pytest.mark.clause("ENG-15")
def test_stop_token_ids_finish_request() -> None:
    """ENG-15: a drawn stop token ends its request ("stop") and leaves the scheduler's decisions identical to
    the reference's; the other requests run on unchanged."""
    folder = checkpoint("llama")
    plain = hf_greedy(folder, PROMPTS, [16] * len(PROMPTS))
    stop = plain[0][4]
    llm = LLM(str(folder), dtype="float64", device="cpu", check=True, kvcache_block_size=4, num_kvcache_blocks=40)
    params = [SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=(stop,)) for _ in PROMPTS]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for o, full in zip(outs, plain, strict=True):
        cut = full[: full.index(stop) + 1] if stop in full else full
        assert o.token_ids == cut
        assert o.finish_reason == ("stop" if stop in full else "length")
    assert llm.engine.stats.compared_steps == llm.engine.stats.steps
