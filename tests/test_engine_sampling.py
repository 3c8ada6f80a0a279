"""Seeded sampling is a function of (seed, position): the same tokens alone or in a crowd, preempted or not."""

from __future__ import annotations

import random
from functools import partial
from typing import Any

import pytest

from optimized import SamplingParams
from tests.engine_fixtures import VOCAB, make_llm

pytestmark = pytest.mark.usefixtures("engine_env")


RNG = random.Random(11)
TARGET = [RNG.randrange(VOCAB) for _ in range(13)]
CROWD = [[RNG.randrange(VOCAB) for _ in range(RNG.randrange(3, 24))] for _ in range(7)]
SEEDED = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=20, seed=42)


make = partial(make_llm, num_kvcache_blocks=96)


def crowd_params() -> list[SamplingParams]:
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=17),
        SamplingParams(temperature=0.8, max_tokens=23),
        SamplingParams(temperature=1.3, top_k=5, max_tokens=19, seed=7),
    ]
    return [kinds[i % 3] for i in range(len(CROWD))]


@pytest.mark.clause("ENG-8")
def test_seeded_request_same_alone_and_in_a_crowd() -> None:
    """ENG-8: a seeded request's tokens do not depend on its neighbours, chunking, block size or preemption."""
    alone = make().generate([TARGET], SEEDED, use_tqdm=False)[0].token_ids
    assert len(set(alone)) > 5
    regimes: list[dict[str, Any]] = [
        {},
        {"kvcache_block_size": 2, "num_kvcache_blocks": 24},  # preemption
        {"kvcache_block_size": 8, "max_num_batched_tokens": 5},  # chunked prefill
        {"kvcache_block_size": 16, "num_kvcache_blocks": 32, "max_num_seqs": 2},
    ]
    preempted = 0
    for kwargs in regimes:
        llm = make(**kwargs)
        prompts = [*CROWD[:3], TARGET, *CROWD[3:]]
        params = [*crowd_params()[:3], SEEDED, *crowd_params()[3:]]
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert outs[3].token_ids == alone, kwargs
        preempted += llm.engine.stats.preemptions
    assert preempted > 0


@pytest.mark.clause("ENG-8", "ENG-9")
def test_different_seeds_differ_and_unseeded_requests_are_reproducible() -> None:
    """ENG-8, ENG-9: different seeds draw different tokens; unseeded requests draw their seed from the LLM's own
    generator at add time: reproducible for the same LLM seed, different between requests."""
    llm = make()
    a, b = llm.generate([TARGET, TARGET], [SEEDED, SamplingParams(**{**SEEDED.__dict__, "seed": 43})], False)
    assert a.token_ids != b.token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=20)
    first = [o.token_ids for o in make(seed=5).generate([TARGET, TARGET], unseeded, use_tqdm=False)]
    again = [o.token_ids for o in make(seed=5).generate([TARGET, TARGET], unseeded, use_tqdm=False)]
    other = [o.token_ids for o in make(seed=6).generate([TARGET, TARGET], unseeded, use_tqdm=False)]
    assert first == again
    assert first[0] != first[1]
    assert first != other
