"""BI-14: served equals offline in float32, the default dtype, with the batch-invariant mode on: 32 clients at once
(the real ``openai`` client against a spawned server) get the tokens and the logprobs, bit for bit, that
``LLM.generate`` gives each request alone."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kernels import cpu_build
from optimized import LLM, SamplingParams
from tests.test_serve import BLOCKS, KEY, Served, body, legacy_logprobs, spawn, stop, token_ids

pytestmark = pytest.mark.clause("BI-14")


@pytest.fixture(scope="module")
def offline(serve_cache: Path) -> LLM:
    if cpu_build.find_compiler() is None:
        pytest.skip("no C compiler on the PATH: the mode is refused")
    return LLM(None, dtype="float32", batch_invariant=True, num_kvcache_blocks=BLOCKS)


@pytest.fixture(scope="module")
def server(offline: LLM, serve_cache: Path) -> Iterator[Served]:
    served = spawn(["--dtype", "float32", "--batch-invariant", "--api-key", KEY, "--num-kvcache-blocks", str(BLOCKS)],
                   serve_cache / "server-float32.log")
    try:
        yield served
    finally:
        stop(served)


def params_of(i: int) -> SamplingParams:
    """Every other client greedy, the rest seeded; each asks for 3 top logprobs."""
    if i % 2:
        return SamplingParams(temperature=0.0, max_tokens=8 + i % 5, ignore_eos=True, logprobs=3)
    return SamplingParams(temperature=0.9, seed=100 + i, max_tokens=8 + i % 5, ignore_eos=True, logprobs=3)


def float_bits(values: list[float]) -> list[bytes]:
    return [struct.pack("<d", v) for v in values]


def test_served_equals_offline_in_float32_with_32_concurrent_clients(server: Served, offline: LLM) -> None:
    """BI-14: 32 clients at once, greedy and seeded, each asking for logprobs: each gets exactly the tokens and the
    float32 logprobs (as JSON numbers, read back bit for bit) that the offline LLM gives its request alone."""
    prompts = [f"client {i}: " + "ab" * (i % 7) for i in range(32)]

    def ask(i: int) -> Any:
        got = server.client.completions.create(**body(prompts[i], params_of(i)), logprobs=3)
        return got.choices[0]

    with ThreadPoolExecutor(32) as pool:
        served = list(pool.map(ask, range(32)))
    for i in range(32):
        want = offline.generate([prompts[i]], params_of(i), use_tqdm=False)[0]
        assert token_ids(served[i]) == want.token_ids, i
        got = served[i].logprobs.model_dump()
        expected = legacy_logprobs(offline, want)
        assert got == expected, i
        assert float_bits(got["token_logprobs"]) == float_bits(expected["token_logprobs"]), i
        assert all(struct.unpack("<f", struct.pack("<f", v))[0] == v for v in got["token_logprobs"])  # float32 values
