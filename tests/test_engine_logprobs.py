"""Logprobs (ENG-18..ENG-20): the model's raw log_softmax, transformers' in float64, in every scheduling regime."""

from __future__ import annotations

import random
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.sampling import log_probs, token_ranks, top_logprobs
from optimized import RequestRefused, SamplingParams
from optimized.engine import logprobs, model_runner
from optimized.engine.sampling_params import Logprob
from optimized.entry.llm import RequestOutput
from tests.engine_fixtures import VOCAB, checkpoint, hf_model, make_llm, one_thread

pytestmark = pytest.mark.usefixtures("engine_env")

RNG = random.Random(5)
PROMPTS = [[RNG.randrange(VOCAB) for _ in range(n)] for n in (1, 2, 9, 17, 30)]
SHARED = [RNG.randrange(VOCAB) for _ in range(24)]  # a prefix two requests share: a prefix-cache hit
make = partial(make_llm, num_kvcache_blocks=64)
# transformers computes RoPE's cos and sin in float32 even for a float64 model, the engine in float64: their
# float64 logprobs differ by up to about 1e-7 (measured 3e-7 at most here). Exactness against the engine's own
# logits is test_logprobs_are_exactly_reproducible_alone_and_follow_the_logits's.
HF_TOLERANCE = 2e-6


def hf_logprobs(family: str, ids: list[int]) -> np.ndarray:
    """float64[len(ids), V]: transformers' log_softmax of its logits at every position of ``ids``."""
    with torch.no_grad():
        logits = hf_model(checkpoint(family))(torch.tensor([ids])).logits[0]
    out: np.ndarray = torch.log_softmax(logits.double(), dim=-1).numpy()
    return out


def expected_entry(row: np.ndarray, token: int, k: int) -> dict[int, tuple[float, int]]:
    """ENG-18's dict for one position, computed independently: the top k by (-logprob, id), then ``token``."""
    order = sorted(range(len(row)), key=lambda t: (-row[t], t))
    out = {t: (float(row[t]), rank) for rank, t in enumerate(order[:k], 1)}
    if token not in out:
        out[token] = (float(row[token]), order.index(token) + 1)
    return out


def assert_matches_hf(family: str, out: RequestOutput, k: int, prompt_k: int | None) -> None:
    """Every generated token's dict (and every prompt token's) equals transformers' within HF_TOLERANCE, same ids and
    ranks in the same order."""
    ids = out.prompt_token_ids + out.token_ids
    ref = hf_logprobs(family, ids)
    n = len(out.prompt_token_ids)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    wanted: list[tuple[dict[int, Logprob] | None, int, int]] = [(out.logprobs[j], n + j, k)
                                                                 for j in range(len(out.token_ids))]
    if prompt_k is not None:
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == n and out.prompt_logprobs[0] is None
        wanted += [(out.prompt_logprobs[p], p, prompt_k) for p in range(1, n)]
    else:
        assert out.prompt_logprobs is None
    for got, position, count in wanted:
        assert got is not None
        exp = expected_entry(ref[position - 1], ids[position], count)
        assert list(got) == list(exp), position
        for t, (value, rank) in exp.items():
            assert got[t].rank == rank
            assert got[t].logprob == pytest.approx(value, abs=HF_TOLERANCE, rel=0)


@pytest.mark.clause("ENG-18", "ENG-19")
@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_logprobs_are_transformers_log_softmax(family: str) -> None:
    """ENG-18, ENG-19: greedy and seeded requests' logprobs and prompt logprobs are transformers' log_softmax in
    float64 (to RoPE's float32 in transformers), the top-K ids exactly, in order, with their ranks; K = 0 holds
    only the drawn token."""
    params = [SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, prompt_logprobs=3),
              SamplingParams(temperature=1.0, max_tokens=7, seed=3, logprobs=0, prompt_logprobs=0),
              SamplingParams(temperature=0.7, top_p=0.8, max_tokens=5, seed=4, logprobs=20),
              SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, prompt_logprobs=20),
              SamplingParams(temperature=1.3, top_k=3, max_tokens=8, seed=5, logprobs=2, prompt_logprobs=1)]
    with one_thread():
        outs = make(family=family).generate(PROMPTS, params, use_tqdm=False)
    for out, sp in zip(outs, params, strict=True):
        assert sp.logprobs is not None
        assert_matches_hf(family, out, sp.logprobs, sp.prompt_logprobs)
    assert all(len(d) == 1 for d in outs[1].logprobs or [])  # K = 0: the drawn token alone
    assert all(d is None or len(d) == 1 for d in outs[1].prompt_logprobs or [])


@pytest.mark.clause("ENG-18", "ENG-20", "ENG-5", "ENG-3", "ENG-4")
@pytest.mark.parametrize("regime", [
    {"kvcache_block_size": 2, "num_kvcache_blocks": 40},  # preemption and recompute
    {"max_num_batched_tokens": 7},  # chunked prefill
    {"attention_backend": "torch"},  # decode rows reordered by context length
    {"enforce_eager": False},  # decode through the graph runner's stand-in
])
def test_logprobs_in_every_regime(regime: dict[str, Any]) -> None:
    """ENG-20: prompt logprobs across chunks, for prefix-cache hits (recomputed, nothing stored) and after a
    preemption (no position twice), and generated tokens' logprobs, all equal to transformers'; the regime
    happened."""
    prompts = [[*SHARED, 1, 2, 3], *PROMPTS[2:], [*SHARED, 7, 8], SHARED]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=12, logprobs=i % 4,
                             prompt_logprobs=None if i == 1 else 2) for i in range(len(prompts))]
    with one_thread():
        llm = make(**regime)
        first = llm.generate(prompts[:1], params[:1], use_tqdm=False)  # its blocks are cached for the others
        outs = first + llm.generate(prompts[1:], params[1:], use_tqdm=False)
    stats = llm.stats
    assert stats.prefix_cache_hit_tokens >= 2 * 20
    if "num_kvcache_blocks" in regime:
        assert stats.preemptions > 0
    if "max_num_batched_tokens" in regime:
        assert stats.chunked_prefills > 0
    for out, sp in zip(outs, params, strict=True):
        assert sp.logprobs is not None
        assert_matches_hf("qwen3", out, sp.logprobs, sp.prompt_logprobs)


@pytest.mark.clause("ENG-20")
def test_a_whole_prompt_from_the_cache_still_gets_its_prompt_logprobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """ENG-20: a prompt the prefix cache holds but for its last token (every earlier position a hit) gets every
    prompt logprob, recomputed by a forward that stores nothing: no store is asked for a slot of the hit blocks
    (a store of the same values would leave the cache unchanged, so the stores themselves are watched), and the
    cached KV is unchanged, bit for bit."""
    from kernels import paged_attention

    prompt = SHARED + SHARED[:8]  # 32 tokens: 7 whole blocks of 4 are hits the second time
    llm = make()
    stored: list[int] = []
    real_store = paged_attention.store_kv

    def watched_store(k: Any, v: Any, k_cache: Any, v_cache: Any, slot_mapping: torch.Tensor) -> None:
        stored.extend(int(s) for s in slot_mapping.tolist() if s >= 0)
        real_store(k, v, k_cache, v_cache, slot_mapping)

    with one_thread():
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        cache = llm.engine.runner.kv_cache.clone()
        monkeypatch.setattr(paged_attention, "store_kv", watched_store)
        rid = llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2, logprobs=1, prompt_logprobs=4))
        outs = llm.step()
        hit_slots = {b * 4 + o for b in llm.engine.by_arrival[rid].seq.block_table[:7] for o in range(4)}
        assert stored and not hit_slots & set(stored), sorted(hit_slots & set(stored))
        hits = llm.engine.by_arrival[rid].seq.block_table[:7]
        while llm.has_unfinished_requests():
            outs += llm.step()
    assert llm.stats.prefix_cache_hit_tokens == 28
    assert torch.equal(llm.engine.runner.kv_cache[:, :, hits], cache[:, :, hits])
    written = (llm.engine.runner.kv_cache != cache).flatten(4).any(-1)  # [layer, k/v, block, offset]
    assert int(written.sum()) <= 2 * 2 * 5  # at most the positions computed, 28..32, in each layer's k and v
    [out] = outs
    assert_matches_hf("qwen3", out, 1, 4)


@pytest.mark.clause("ENG-19")
def test_logprobs_are_exactly_reproducible_alone_and_follow_the_logits() -> None:
    """ENG-19: the same request twice gives the same bits; each drawn token's logprob is log_softmax of the
    logits the sampler saw (the runner's logits observer), bit for bit."""
    params = SamplingParams(temperature=0.9, seed=8, max_tokens=10, logprobs=3, prompt_logprobs=3)
    seen: list[torch.Tensor] = []
    with one_thread():
        a = make(dtype="float32").generate([PROMPTS[3]], params, use_tqdm=False)[0]
        llm = make(dtype="float32")
        llm.engine.runner.logits_observer = lambda seqs, logits: seen.append(logits.clone())
        b = llm.generate([PROMPTS[3]], params, use_tqdm=False)[0]
    assert a.logprobs == b.logprobs and a.prompt_logprobs == b.prompt_logprobs
    assert b.logprobs is not None and len(seen) == len(b.token_ids)
    for logits, token, entry in zip(seen, b.token_ids, b.logprobs, strict=True):
        assert entry[token].logprob == torch.log_softmax(logits[0], dim=-1)[token].item()


@pytest.mark.clause("ENG-19")
def test_a_step_nobody_asked_does_no_logprob_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """ENG-19: without logprobs no prompt plan, no logprob and no logits row beyond the sampled ones; with them,
    exactly the prompt rows asked."""
    calls: dict[str, int] = {"plan": 0, "step": 0}
    real_plan, real_step = logprobs.prompt_plan, logprobs.step_logprobs

    def plan(*args: Any) -> Any:
        calls["plan"] += 1
        return real_plan(*args)

    def step(*args: Any) -> Any:
        calls["step"] += 1
        return real_step(*args)

    monkeypatch.setattr(model_runner, "prompt_plan", plan)
    monkeypatch.setattr(model_runner, "step_logprobs", step)
    llm = make()
    rows: list[int] = []
    logits = llm.engine.runner.model.logits

    def counted(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return logits(hidden)

    monkeypatch.setattr(llm.engine.runner.model, "logits", counted)
    with one_thread():
        llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
        assert calls == {"plan": 0, "step": 0} and sum(rows) == 3 * len(PROMPTS)
        rows.clear()
        llm.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1), use_tqdm=False)
    assert sum(rows) == 3 + len(PROMPTS[2]) - 1 and calls["plan"] == 1


@pytest.mark.clause("ENG-19")
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 300), vocab=st.sampled_from([2, 7, 33, 257, 1000, 4099]), threads=st.sampled_from([1, 2]),
       wide=st.booleans(), seed=st.integers(0, 2**31))
def test_log_probs_of_a_row_do_not_depend_on_its_batch(rows: int, vocab: int, threads: int, wide: bool,
                                                        seed: int) -> None:
    """ENG-19: a row's log_probs alone equal its row in the whole batch and in any slice, bit for bit, at 1 and 2
    threads, in float32 and float64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g, dtype=torch.float64 if wide else torch.float32) * 8
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = log_probs(x)
        i = seed % rows
        assert torch.equal(log_probs(x[i : i + 1])[0], whole[i])
        a = seed % (rows + 1)
        assert torch.equal(log_probs(x[a:]), whole[a:])
    finally:
        torch.set_num_threads(before)
    assert whole.dtype == x.dtype


@pytest.mark.clause("ENG-19")
def test_top_logprobs_break_ties_by_token_id() -> None:
    """ENG-19: the top K by descending logprob, ties (at the K-th value too) to the lower id; ranks agree."""
    lp = torch.tensor([[0.0, 1.0, 1.0, 1.0, -2.0, 5.0], [3.0, 3.0, 3.0, 3.0, 3.0, 3.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    ids, values = top_logprobs(lp, 3)
    assert ids.tolist() == [[5, 1, 2], [0, 1, 2], [5, 4, 3]]
    assert values.tolist() == [[5.0, 1.0, 1.0], [3.0, 3.0, 3.0], [6.0, 5.0, 4.0]]
    chosen, ranks = token_ranks(lp, torch.tensor([3, 4, 0]))
    assert chosen.tolist() == [1.0, 3.0, 1.0] and ranks.tolist() == [4, 5, 6]
    assert top_logprobs(lp, 0)[0].shape == (3, 0)


@pytest.mark.clause("ENG-18", "ENG-10", "ARCH-6")
@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("bad", [-1, 21, True, 1.5, "3", [1]])
def test_bad_logprob_counts_are_refused_naming_the_field(field: str, bad: object) -> None:
    """ENG-18: a count that is no integer in [0, 20] (a bool, a float, a negative or larger one) is refused when
    the params are made, naming the field; 0, 20, None and a numpy integer are taken."""
    kwargs: Any = {field: bad}
    with pytest.raises(RequestRefused) as caught:
        SamplingParams(**kwargs)
    assert caught.value.field == field and str(caught.value).startswith(field)
    for good, stored in [(0, 0), (20, 20), (None, None), (np.int64(4), 4)]:
        kwargs = {field: good}
        value = getattr(SamplingParams(**kwargs), field)
        assert value == stored and type(value) is type(stored)


@pytest.mark.clause("ENG-18")
def test_not_asked_is_none_and_an_abort_keeps_what_it_got() -> None:
    """ENG-18: outputs carry no logprobs unless asked; an aborted request's output holds one dict per token."""
    llm = make()
    out = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.logprobs is None and out.prompt_logprobs is None
    rid = llm.add_request(PROMPTS[3], SamplingParams(max_tokens=20, logprobs=2))
    for _ in range(4):
        llm.step()
    aborted = llm.abort(rid)
    assert aborted is not None and aborted.logprobs is not None
    assert len(aborted.logprobs) == len(aborted.token_ids) > 0
    assert all(isinstance(v, Logprob) for d in aborted.logprobs for v in d.values())


@pytest.mark.clause("ENG-19")
def test_many_rows_taken_in_slices_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """ENG-19: a prompt's rows are ranked in slices (bounded memory); since every value is its own row's, the
    slices give the bits of one pass over every row, counts differing per row included."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(70, VOCAB, generator=gen)
    logits[5, :8] = logits[5, 8]  # ties, ranked by id
    tokens = [int(t) for t in torch.randint(0, VOCAB, (70,), generator=gen)]
    counts = [i % 5 for i in range(70)]
    whole = logprobs.row_logprobs(logits, tokens, counts)
    monkeypatch.setattr(logprobs, "ROWS_AT_ONCE", 16)
    assert logprobs.row_logprobs(logits, tokens, counts) == whole
