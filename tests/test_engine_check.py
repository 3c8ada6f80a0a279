"""Check mode: the reference scheduler shadows the engine's; any divergence or broken invariant raises."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import pytest

from optimized import LLM, SamplingParams
from optimized.verify.shadow import ShadowDivergence
from tests.engine_fixtures import checkpoint, make_llm, with_config

pytestmark = pytest.mark.usefixtures("engine_env")


PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


make = partial(make_llm, kvcache_block_size=2, num_kvcache_blocks=32)


@pytest.mark.clause("ENG-22")
def test_check_mode_is_off_by_default_and_counts_steps() -> None:
    """ENG-22: check mode is off unless asked; when on, every step is compared."""
    assert LLM(str(checkpoint("qwen3")), num_kvcache_blocks=8).shadow is None
    llm = make()
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.stats.compared_steps == llm.engine.stats.steps > 0


@pytest.mark.clause("ENG-22")
def test_reordered_batch_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """ENG-22: a batch in another order than the reference's raises, with both states dumped."""
    llm = make()
    real = llm.engine.scheduler.schedule

    def reordered() -> Any:
        out = real()
        return dataclasses.replace(out, batch=list(reversed(out.batch)))

    monkeypatch.setattr(llm.engine.scheduler, "schedule", reordered)
    with pytest.raises(ShadowDivergence, match="batch") as err:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert "--- engine scheduler ---" in str(err.value) and "--- reference scheduler ---" in str(err.value)


@pytest.mark.clause("ENG-22")
def test_different_finish_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """ENG-22: a scheduler that finishes other requests than the reference raises."""
    llm = make(with_config("qwen3", "eos7", eos_token_id=7))
    real = llm.engine.scheduler.postprocess

    def all_eos(seqs: Any, tokens: list[int], is_prefill: bool) -> Any:
        return real(seqs, [7 if t >= 0 else t for t in tokens], is_prefill)

    monkeypatch.setattr(llm.engine.scheduler, "postprocess", all_eos)
    with pytest.raises(ShadowDivergence, match="finished"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)


@pytest.mark.clause("ENG-22")
def test_corrupted_block_table_is_caught() -> None:
    """ENG-22: a block table corrupted between steps is caught at the next comparison."""
    llm = make()
    requests = [llm.engine.add(p, GREEDY, seed=0) for p in PROMPTS]
    llm.engine.step()
    victim = next(r.seq for r in requests if r.seq.block_table)
    victim.block_table.append(victim.block_table[0])
    with pytest.raises(ShadowDivergence, match="check mode"):
        while llm.engine.has_unfinished():
            llm.engine.step()
