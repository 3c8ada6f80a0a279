"""Decode through GraphRunner (``enforce_eager=False``; the CPU stand-in graph) equals eager decode token for token."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from optimized import LLM, SamplingParams
from optimized.engine.graph_runner import EagerGraph
from tests.engine_fixtures import VOCAB, checkpoint

pytestmark = pytest.mark.usefixtures("engine_env")


RNG = random.Random(5)
BASE = [RNG.randrange(VOCAB) for _ in range(12)]
# 24 requests, half sharing a 12-token prefix (prefix-cache hits once the first is cached), of mixed lengths so the
# decode batch shrinks through several buckets as requests finish.
PROMPTS = [(BASE if i % 2 else []) + [RNG.randrange(VOCAB) for _ in range(RNG.randrange(1, 14))] for i in range(24)]
PARAMS = [
    SamplingParams(temperature=0.0 if i % 3 else 0.9, max_tokens=2 + (7 * i) % 19, seed=None if i % 4 else i)
    for i in range(24)
]
# A small cache with max_num_seqs 20 (buckets 1, 2, 4, 8, 16, 20): preemption happens, batches of every size.
SETTINGS: dict[str, Any] = {"kvcache_block_size": 4, "num_kvcache_blocks": 40, "max_num_seqs": 20}


def run(enforce_eager: bool | None, **extra: Any) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(checkpoint("qwen3")), dtype="float64", check=True, enforce_eager=enforce_eager, **SETTINGS, **extra)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return llm, [o.token_ids for o in outs]


@pytest.mark.clause("ENG-28", "KERN-16", "KERN-17", "KERN-18", "KERN-19")
def test_graph_decode_equals_eager_across_buckets_preemption_and_prefix_hits() -> None:
    """ENG-28, KERN-16, KERN-17, KERN-18, KERN-19: with enforce_eager=False every decode step replays a bucket's
    graph over the static buffers, and the tokens (greedy and seeded) equal eager decode's, with preemptions and
    prefix-cache hits happening and decisions identical to the reference (check mode)."""
    eager, expected = run(True)
    graphed, got = run(False)
    assert got == expected
    stats, runner = graphed.engine.stats, graphed.engine.runner
    assert stats.preemptions > 0 and stats.prefix_cache_hit_tokens > 0
    assert stats.compared_steps == stats.steps
    assert eager.engine.runner.graphs is None and eager.engine.runner.graph_steps == 0
    graphs = runner.graphs
    assert graphs is not None
    # Every decode step ran through a replay, and the replays spread over several buckets.
    assert runner.graph_steps == stats.decode_steps > 0
    replays = {b: g.replays for b, g in graphs.graphs.items() if isinstance(g, EagerGraph)}
    assert len(replays) == len(graphs.graphs) and sum(replays.values()) == stats.decode_steps
    assert len([b for b, n in replays.items() if n > 0]) >= 4
    assert graphs.block_tables.shape[1] == -(-graphed.engine.limits.max_model_len // 4)


@pytest.mark.clause("ENG-28", "KERN-18")
def test_graph_buffers_are_cleared_between_steps() -> None:
    """ENG-28, KERN-18: after the run the static block table holds only the last step's rows; the rest is -1."""
    llm, _ = run(False)
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    live = int((graphs.context_lens > 0).sum())
    assert bool((graphs.block_tables[live:] == -1).all())
    assert bool((graphs.slot_mapping[live:] == -1).all())


@pytest.mark.clause("ENG-17", "ENG-28")
def test_enforce_eager_default_and_validation() -> None:
    """ENG-17, ENG-28: enforce_eager None means eager on the CPU; a non-bool is a ValueError naming the field."""
    llm = LLM(str(checkpoint("qwen3")), dtype="float64", **SETTINGS)
    assert llm.enforce_eager is True and llm.engine.runner.graphs is None
    with pytest.raises(ValueError, match="enforce_eager"):
        LLM(str(checkpoint("qwen3")), enforce_eager="no")


@pytest.mark.clause("ENG-28")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_refuse_the_torch_backend() -> None:
    """ENG-28: on CUDA, graphs need a capturable backend; the torch store_kv syncs with the host."""
    with pytest.raises(ValueError, match="enforce_eager"):
        LLM(str(checkpoint("qwen3")), device="cuda", enforce_eager=False, attention_backend="torch")
