"""Tensor parallelism is token-exact: TP=2 over two gloo processes against TP=1 and against transformers.

One TP=2 engine per family for the whole module (each spawns one worker), greedy float64 under settings where
prefix-cache hits, chunked prefill and preemption all happen, check mode on; seeded sampling gives the same tokens
as TP=1. A checkpoint with one KV head exercises the replicated KV head.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from optimized import LLM, SamplingParams
from optimized.models.config import load_config
from optimized.models.sharding import Shard
from optimized.parallel.group import TensorParallelError
from tests.engine_fixtures import FAMILIES, checkpoint, hf_greedy
from tests.test_engine_exact import MAX_TOKENS, PROMPTS

pytestmark = pytest.mark.usefixtures("engine_env")

# Prefix-cache hits (3 sequences at a time over shared prefixes), chunked prefill (7-token budget) and preemption
# (30 blocks of 2 tokens) in one run.
SETTINGS: dict[str, Any] = {
    "dtype": "float64",
    "check": True,
    "kvcache_block_size": 2,
    "num_kvcache_blocks": 30,
    "max_num_seqs": 3,
    "max_num_batched_tokens": 7,
}
GREEDY = [SamplingParams(temperature=0.0, max_tokens=m) for m in MAX_TOKENS]
SEEDED = [SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_tokens=m, seed=i) for i, m in enumerate(MAX_TOKENS)]


GRAPHED = "qwen3"  # this family's engines decode through the graph runner (its eager stand-ins on the CPU)


def _settings(family: str) -> dict[str, Any]:
    return {**SETTINGS, "enforce_eager": family != GRAPHED}


@pytest.fixture(scope="module", params=FAMILIES)
def tp2(request: pytest.FixtureRequest) -> Iterator[tuple[str, LLM]]:
    family = str(request.param)
    with LLM(str(checkpoint(family)), tensor_parallel_size=2, **_settings(family)) as llm:
        yield family, llm


def _tokens(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.clause("TP-4", "TP-5", "TP-6", "TP-7")
def test_tp2_greedy_equals_transformers_and_tp1(tp2: tuple[str, LLM]) -> None:
    """TP-4, TP-5, TP-6, TP-7: TP=2 greedy float64 is transformers' and TP=1's token for token, with prefix-cache
    hits, chunked prefill and preemption happening, every step shadowed by the reference on rank 0. TP-7: one
    family decodes through the graph runner on every rank (the header's graphed flag), eagerly elsewhere."""
    family, llm = tp2
    folder = checkpoint(family)
    before, graphed = llm.engine.stats.steps, llm.engine.runner.graph_steps
    got = _tokens(llm, GREEDY)
    assert got == hf_greedy(folder, PROMPTS, MAX_TOKENS)
    assert got == _tokens(LLM(str(folder), **_settings(family)), GREEDY)
    assert (llm.engine.runner.graph_steps > graphed) == (family == GRAPHED)
    st = llm.engine.stats
    assert st.prefix_cache_hit_tokens > 0 and st.chunked_prefills > 0 and st.preemptions > 0, st
    assert st.compared_steps == st.steps > before
    runner = llm.engine.runner
    c = load_config(folder)
    # Rank 0 holds half the heads, half the KV heads (its cache too) and half the MLP.
    assert runner.kv_cache.shape[-2] == c.num_kv_heads // 2
    assert runner.model.local_config.intermediate_size == c.intermediate_size // 2
    assert runner.model.local_config.num_heads == c.num_heads // 2
    assert runner.num_blocks == SETTINGS["num_kvcache_blocks"]


@pytest.mark.clause("TP-6")
def test_tp2_seeded_sampling_equals_tp1(tp2: tuple[str, LLM]) -> None:
    """TP-6: seeded sampling draws the same tokens at TP=2 as at TP=1 (rank 0 samples from the gathered logits)."""
    family, llm = tp2
    got = _tokens(llm, SEEDED)
    assert got == _tokens(LLM(str(checkpoint(family)), **_settings(family)), SEEDED)
    assert len({t for out in got for t in out}) > 20


def _one_kv_head_checkpoint(folder: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(99)
    config = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=16, vocab_size=255, max_position_embeddings=128,
                         initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    Qwen3ForCausalLM(config).save_pretrained(str(folder))
    return folder


@pytest.mark.clause("TP-4", "TP-5", "TP-3", "TP-10")
def test_one_kv_head_is_replicated_and_odd_vocabulary_padded(tmp_path: Path) -> None:
    """TP-4, TP-5: one KV head over two ranks is replicated (each rank holds it, its cache too), and a vocabulary of
    255 is cut into two pieces of 128 (the last padded): output is still transformers' token for token. TP-3:
    leaving the ``with`` block stops the worker (exit status 0), and the closed LLM refuses to step. TP-10: rank 0
    runs on its share of the threads (2 // 2) while open, the caller's count back after close."""
    folder = _one_kv_head_checkpoint(tmp_path / "kv1")
    c = load_config(folder)
    assert [Shard(r, 2).kv_rows(c) for r in (0, 1)] == [(0, 16), (0, 16)]
    assert [Shard(r, 2).vocab_range(c) for r in (0, 1)] == [(0, 128), (128, 255)]
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in MAX_TOKENS]
    torch.set_num_threads(2)  # the module's one thread (engine_env) comes back below
    try:
        with LLM(str(folder), tensor_parallel_size=2, dtype="float64", kvcache_block_size=4,
                 num_kvcache_blocks=64) as llm:
            threads_while_open = torch.get_num_threads()
            got = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            assert llm.engine.runner.kv_cache.shape[-2] == 1
            assert llm.engine.runner.model.embed_tokens.weight.shape[0] == 128
            group = llm._group
            assert group is not None
        threads_after = torch.get_num_threads()
    finally:
        torch.set_num_threads(1)
    assert (threads_while_open, threads_after) == (1, 2)
    assert got == hf_greedy(folder, PROMPTS, MAX_TOKENS)
    assert [w.exitcode for w in group.workers] == [0]  # TP-3: leaving the with block stopped the worker
    with pytest.raises(TensorParallelError, match="the LLM was closed"):
        llm.generate(PROMPTS[:1], params[:1], use_tqdm=False)
    llm.close()  # idempotent


@pytest.mark.clause("TP-10")
def test_bench_prints_tp1_and_tp2_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    """TP-10: ``bench throughput --tensor-parallel-size 2`` runs the engine at TP=1 and TP=2 on one workload and
    prints both, rank 0's communication per step and how many requests got the same tokens."""
    import argparse

    from optimized.benchmarks import throughput
    from optimized.engine.args import EngineArgs

    args = argparse.Namespace(num_requests=3, max_input_len=8, max_output_len=4, threads=1, hf_batch_size=None)
    engine = EngineArgs(str(checkpoint("qwen3")), dtype="float64", device="cpu", tensor_parallel_size=2)
    assert throughput.run(args, engine) == 0
    out = capsys.readouterr().out
    assert "nanoverify engine TP=1:" in out and "nanoverify engine TP=2:" in out
    assert "all-reduces of" in out and "logits gathered" in out
    assert "requests with identical tokens on both sides: 3/3" in out
