"""BI-14, a recorded run: in the mode, a run recorded to a trace gives every request the tokens and logprob bits of
its run alone, untraced; the replay hands the scheduler the recorded tokens (it runs no model) and agrees at every
step."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kernels import cpu_build
from optimized.benchmarks.determinism import Difference, difference
from optimized.engine.sampling_params import SamplingParams
from optimized.entry.llm import LLM
from optimized.trace.replay import replay_trace
from optimized.trace.schema import read_trace
from tests.engine_fixtures import VOCAB, checkpoint

pytestmark = [pytest.mark.usefixtures("engine_env"), pytest.mark.clause("BI-14")]


def test_a_recorded_run_is_the_same_bits_and_replays(tmp_path: Path) -> None:
    """BI-14: eight requests (greedy and seeded, with logprobs and prompt logprobs), chunked by a budget of 7 and
    preempted by 14 KV blocks, recorded to a trace: each equals its run alone in a fresh untraced engine, bit for
    bit, and the trace replays through the reference scheduler identically."""
    if cpu_build.find_compiler() is None:
        pytest.skip("no C compiler on the PATH: the mode is refused")
    rng = random.Random(4)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 24))] for _ in range(8)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=8, ignore_eos=True, logprobs=2,
                             prompt_logprobs=2) for i in range(8)]
    path = tmp_path / "run.jsonl"
    common = {"dtype": "float32", "batch_invariant": True, "kvcache_block_size": 4}
    with LLM(str(checkpoint("qwen3")), trace=str(path), max_num_batched_tokens=7, num_kvcache_blocks=14,
             **common) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.stats.preemptions > 0 and llm.stats.chunked_prefills > 0
    for p, sp, out in zip(prompts, params, outs, strict=True):
        alone = LLM(str(checkpoint("qwen3")), num_kvcache_blocks=64, **common).generate([p], [sp], use_tqdm=False)[0]
        assert difference(alone, out) == Difference(None, None)
    outcome = replay_trace(read_trace(path.read_bytes().splitlines(keepends=True)), "reference")
    assert outcome.ok and outcome.identical == outcome.steps > 0, outcome.difference
