"""The engine's step-level API and LLM.abort (spec/abort.md, beyond the lesson), all in check mode.

A tiny float64 Qwen3 checkpoint; greedy outputs are compared with a fresh
engine's, so aborting one request is seen to change no other request's tokens.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

from invariants import check_state, snapshot
from optimized import LLM, RequestOutput, SamplingParams
from tests.engine_fixtures import make_llm

pytestmark = pytest.mark.usefixtures("engine_env")


GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PROMPTS = [list(range(10, 19)), [7, 8, 9], list(range(30, 40))]


make = partial(make_llm, num_kvcache_blocks=16, max_model_len=96)


def fresh(prompts: list[list[int]], **kwargs: Any) -> list[list[int]]:
    return [o.token_ids for o in make(**kwargs).generate(prompts, GREEDY, use_tqdm=False)]


def drain(llm: LLM) -> dict[int, RequestOutput]:
    """Step until nothing is unfinished; every output by request id (each returned exactly once)."""
    outputs: dict[int, RequestOutput] = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert out.request_id not in outputs
            outputs[out.request_id] = out
    return outputs


def assert_idle(llm: LLM) -> None:
    """ABORT-5: every invariant holds on both schedulers, and no block is used once everything finished."""
    assert llm.shadow is not None
    for sched in (llm.engine.scheduler, llm.shadow.ref):
        state = snapshot(sched)
        assert check_state(state) == [] and state.used_block_ids == set()
    assert llm.engine.live == {} and llm.shadow.by_arrival == {}
    assert llm.engine.stats.compared_steps == llm.engine.stats.steps


@pytest.mark.clause("ABORT-7")
def test_step_api_serves_what_generate_serves() -> None:
    """ABORT-7: add_request/step/has_unfinished_requests give generate()'s tokens; each output comes back once."""
    llm = make()
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    assert ids == [0, 1, 2] and llm.has_unfinished_requests()
    outputs = drain(llm)
    assert [outputs[i].token_ids for i in ids] == fresh(PROMPTS)
    assert {o.finish_reason for o in outputs.values()} == {"length"}
    assert llm.step() == [] and not llm.has_unfinished_requests()
    assert_idle(llm)


@pytest.mark.clause("ABORT-7", "ENG-10")
def test_add_request_refuses_like_generate_and_changes_nothing() -> None:
    """ABORT-7, ENG-10: a refused request names the limit; nothing is queued and no seed is drawn."""
    llm = make()
    llm.add_request(PROMPTS[0], GREEDY)
    llm.step()
    assert llm.shadow is not None
    before = (snapshot(llm.engine.scheduler), snapshot(llm.shadow.ref), sorted(llm.engine.live),
              llm._rng.getstate())
    for prompt, params, field in (([], GREEDY, "prompt"), ([1, 300], GREEDY, "vocab_size"),
                                  ([1] * 60, SamplingParams(temperature=0.0, max_tokens=37), "max_model_len"),
                                  ([1] * 70, SamplingParams(max_tokens=8), "num_kvcache_blocks")):
        with pytest.raises(ValueError, match=field):
            llm.add_request(prompt, params)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.add_request(PROMPTS[1], "greedy")  # type: ignore[arg-type]
    after = (snapshot(llm.engine.scheduler), snapshot(llm.shadow.ref), sorted(llm.engine.live),
             llm._rng.getstate())
    assert after == before
    assert llm.add_request(PROMPTS[1], GREEDY) == 1  # the refused ones took no id
    drain(llm)
    assert_idle(llm)


@pytest.mark.clause("ABORT-1", "ABORT-8")
def test_abort_a_waiting_request() -> None:
    """ABORT-1, ABORT-8: aborted before its first step: no tokens, finish_reason abort, never returned by step()."""
    llm = make()
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    out = llm.abort(ids[1])
    assert out is not None and out.finish_reason == "abort" and out.token_ids == []
    assert out.prompt_token_ids == PROMPTS[1] and out.request_id == 1
    outputs = drain(llm)
    assert sorted(outputs) == [0, 2]
    assert [outputs[0].token_ids, outputs[2].token_ids] == fresh([PROMPTS[0], PROMPTS[2]])
    assert llm.engine.stats.aborted_requests == 1
    assert_idle(llm)


@pytest.mark.clause("ABORT-1", "ABORT-3", "ABORT-6")
def test_abort_mid_chunk_and_the_cache_keeps_its_finished_chunks() -> None:
    """ABORT-1, ABORT-3, ABORT-6: a prompt aborted between two chunks of its prefill; the full blocks its first
    chunk computed are hit by a later request with the same prompt, whose tokens are still exact."""
    llm = make(max_num_batched_tokens=6)
    long = list(range(40, 54))  # 14 tokens: chunks of 6
    first = llm.add_request(long, GREEDY)
    assert llm.step() == []
    head = llm.engine.scheduler.waiting[0]
    assert head.num_cached_tokens == 6 and len(head.block_table) == 4
    out = llm.abort(first)
    assert out is not None and out.finish_reason == "abort" and out.token_ids == []
    hits = llm.engine.stats.prefix_cache_hit_tokens
    again = llm.add_request(long, GREEDY)
    outputs = drain(llm)
    assert llm.engine.stats.prefix_cache_hit_tokens == hits + 4  # the one block the first chunk filled
    assert outputs[again].token_ids == fresh([long])[0]
    assert_idle(llm)


@pytest.mark.clause("ABORT-2", "ABORT-8")
def test_abort_a_running_request_keeps_its_tokens_and_spares_the_others() -> None:
    """ABORT-2, ABORT-8: a running request aborted after some decode steps returns the tokens it had, a prefix of
    its full output; the others are unchanged, and a same-prompt request hits its released blocks."""
    llm = make()
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    for _ in range(3):  # one prefill, two decodes
        assert llm.step() == []
    out = llm.abort(ids[2])
    full = fresh(PROMPTS)
    assert out is not None and out.finish_reason == "abort" and out.token_ids == full[2][:3]
    hits = llm.engine.stats.prefix_cache_hit_tokens
    again = llm.add_request(PROMPTS[2], GREEDY)
    outputs = drain(llm)
    assert sorted(outputs) == [0, 1, again]
    assert [outputs[0].token_ids, outputs[1].token_ids, outputs[again].token_ids] == full
    assert llm.engine.stats.prefix_cache_hit_tokens == hits + 8  # two full prompt blocks of ten tokens
    assert_idle(llm)


@pytest.mark.clause("ABORT-4", "ABORT-8")
def test_abort_refusals_and_no_ops() -> None:
    """ABORT-4, ABORT-8: an id never issued is a ValueError; a finished or already aborted request is left alone."""
    llm = make()
    done = llm.add_request(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=1))
    live = llm.add_request(PROMPTS[0], GREEDY)
    finished = llm.step()
    assert [o.request_id for o in finished] == [done]
    for bad in (2, -1, "0", True):
        with pytest.raises(ValueError, match="request_id"):
            llm.abort(bad)  # type: ignore[arg-type]
    assert llm.shadow is not None
    before = snapshot(llm.engine.scheduler), snapshot(llm.shadow.ref)
    assert llm.abort(done) is None
    assert (snapshot(llm.engine.scheduler), snapshot(llm.shadow.ref)) == before
    assert llm.abort(live) is not None and llm.abort(live) is None
    assert drain(llm) == {}
    assert_idle(llm)


@pytest.mark.clause("ABORT-5", "ABORT-7")
def test_generate_after_aborts_is_exact() -> None:
    """ABORT-5, ABORT-7: aborts leave an engine whose generate() equals a fresh engine's, with no leak."""
    llm = make(num_kvcache_blocks=8, max_num_batched_tokens=8)
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    llm.step()
    for i in ids:
        llm.abort(i)
    assert not llm.has_unfinished_requests()
    assert_idle(llm)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == fresh(PROMPTS)
    assert_idle(llm)
