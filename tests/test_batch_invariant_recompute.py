"""BI-13, the recompute property: in the mode, a generated token's logprobs (decode: one row) equal the prompt
logprobs of the same token when prompt + generated tokens are prefilled again (many rows, chunked or not, cold or
over a prefix cache holding the blocks decode wrote), bit for bit; with the mode off they differ."""

from __future__ import annotations

import random
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import cpu_build
from optimized.engine.sampling_params import Logprob, SamplingParams
from optimized.entry.llm import LLM
from tests.engine_fixtures import VOCAB, at_threads, checkpoint

pytestmark = [pytest.mark.usefixtures("engine_env"), pytest.mark.clause("BI-13")]
K = 4


@pytest.fixture(autouse=True)
def _kernels_built() -> None:
    if cpu_build.find_compiler() is None:
        pytest.skip("no C compiler on the PATH: the mode is refused")


def engine(on: bool, **overrides: Any) -> LLM:
    args: dict[str, Any] = {"dtype": "float32", "batch_invariant": on, "kvcache_block_size": 4,
                            "num_kvcache_blocks": 128, **overrides}
    return LLM(str(checkpoint("qwen3")), **args)


def bits(entries: list[dict[int, Logprob]] | list[dict[int, Logprob] | None]) -> list[Any]:
    return [None if e is None else [(t, struct.pack("<d", lp.logprob), lp.rank) for t, lp in e.items()]
            for e in entries]


def generated(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[Any]]:
    out = llm.generate([prompt], [params], use_tqdm=False)[0]
    assert out.logprobs is not None
    return out.token_ids, bits(out.logprobs)


def reprefilled(llm: LLM, ids: list[int], start: int) -> list[Any]:
    """The prompt logprobs of ``ids[start:]`` when ``ids`` is a prompt (K alternatives, one token generated)."""
    out = llm.generate([ids], [SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=K)], use_tqdm=False)[0]
    assert out.prompt_logprobs is not None
    return bits(out.prompt_logprobs)[start:]


def sampled(seed: int | None, n: int) -> SamplingParams:
    if seed is None:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=K)
    return SamplingParams(temperature=1.0, top_p=0.9, seed=seed, max_tokens=n, ignore_eos=True, logprobs=K)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), greedy=st.booleans(), budget=st.sampled_from([8192, 16, 5]),
       threads=st.sampled_from([1, 2]))
def test_decode_logprobs_equal_the_prompt_logprobs_of_a_re_prefill(seed: int, greedy: bool, budget: int,
                                                                   threads: int) -> None:
    """BI-13: a request's logprobs of its token i (drawn greedily or seeded, from a decode row) equal, bit for bit,
    the prompt logprobs of that token in prompt + tokens[:i + 1] prefilled in a fresh engine (whole or chunked by a
    budget of 16 or 5, at 1 or 2 threads), for three drawn i; and the whole prompt + tokens prefilled once gives them
    all, at every budget and thread count of these."""
    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
    tokens, decoded = generated(engine(True), prompt, sampled(None if greedy else seed, 10))
    for every_threads in (1, 2):
        with at_threads(every_threads):
            for every_budget in (8192, 16, 5):
                fresh = engine(True, max_num_batched_tokens=every_budget)
                assert reprefilled(fresh, prompt + tokens, len(prompt)) == decoded, (every_budget, every_threads)
    with at_threads(threads):
        for i in sorted(rng.sample(range(len(tokens)), 3)):
            assert reprefilled(engine(True, max_num_batched_tokens=budget), prompt + tokens[: i + 1],
                               len(prompt) + i) == decoded[i : i + 1]


def test_over_blocks_decode_wrote_the_re_prefill_is_the_same_bits() -> None:
    """BI-13: prompt + generated tokens + more, sent to the engine that generated them, hits the prefix cache on
    blocks its decode steps wrote (their positions' prompt logprobs recomputed by a forward that stores nothing);
    its prompt logprobs equal the decode's logprobs and a cold engine's prompt logprobs, bit for bit."""
    prompt = [(7 * i + 3) % VOCAB for i in range(10)]
    llm = engine(True)
    tokens, decoded = generated(llm, prompt, sampled(None, 14))
    longer = prompt + tokens + [1, 2, 3]
    hits = llm.stats.prefix_cache_hit_tokens
    hot = reprefilled(llm, longer, 1)
    assert llm.stats.prefix_cache_hit_tokens - hits > len(prompt)  # blocks past the prompt: decode's
    assert hot == reprefilled(engine(True), longer, 1)
    assert hot[len(prompt) - 1 : len(prompt) - 1 + len(tokens)] == decoded


def test_with_the_mode_off_decode_and_re_prefill_differ() -> None:
    """BI-13's negative control: with the mode off, the decode's logprobs and the re-prefill's differ in some bit
    (MKL's product of one row is not its product in many), so the checks above can fail."""
    differ = 0
    for seed in range(3):
        rng = random.Random(seed)
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(5, 30))]
        tokens, decoded = generated(engine(False), prompt, sampled(None, 10))
        differ += reprefilled(engine(False), prompt + tokens, len(prompt)) != decoded
    assert differ > 0
