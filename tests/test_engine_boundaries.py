"""Edges of the engine's boundary found in review: each refused cleanly or given its documented meaning."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

from optimized import LLM, SamplingParams
from optimized.cli import main as cli_main
from optimized.core.errors import WorkloadError
from optimized.verify.conformance import parse_workload
from tests.engine_fixtures import make_llm

pytestmark = pytest.mark.usefixtures("engine_env")


PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]


make = partial(make_llm, num_kvcache_blocks=16, max_model_len=48)


def tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.clause("ENG-12")
def test_a_tiny_temperature_is_greedy() -> None:
    """ENG-12: temperature 1e-40 (finite, positive) gives the greedy tokens, not the garbage of inf logits."""
    llm = make()
    greedy = tokens(llm, SamplingParams(temperature=0.0, max_tokens=6))
    assert tokens(llm, SamplingParams(temperature=1e-40, max_tokens=6, seed=1)) == greedy
    assert len({t for row in greedy for t in row}) > 1


@pytest.mark.clause("ENG-12", "ENG-10")
def test_top_k_past_the_vocabulary_is_off_and_past_int64_refused() -> None:
    """ENG-12, ENG-10: top_k >= vocab draws exactly as top_k=-1; top_k >= 2**63 is refused when made."""
    llm = make()
    off = tokens(llm, SamplingParams(temperature=1.0, max_tokens=6, seed=3))
    assert tokens(llm, SamplingParams(temperature=1.0, max_tokens=6, seed=3, top_k=10**9)) == off
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=1 << 63)
    assert llm.engine.stats.failed_steps == 0


@pytest.mark.clause("ENG-10")
@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: SamplingParams(stop_token_ids=None), "stop_token_ids"),  # type: ignore[arg-type]
        (lambda: SamplingParams(stop_token_ids=5), "stop_token_ids"),  # type: ignore[arg-type]
        (lambda: LLM(3), "model"),  # type: ignore[arg-type]
        (lambda: make(cpu_kvcache_gib=float("inf"), num_kvcache_blocks=None), "cpu_kvcache_gib"),
        (lambda: make(num_kvcache_blocks=10**13), "num_kvcache_blocks"),
    ],
)
def test_bad_arguments_are_value_errors_naming_the_field(call: Any, field: str) -> None:
    """ENG-10: wrong types and impossible budgets are ValueErrors naming the field, not TypeErrors or crashes."""
    with pytest.raises(ValueError, match=field):
        call()


@pytest.mark.clause("ENG-10")
def test_generate_refuses_arguments_of_the_wrong_shape_and_changes_nothing() -> None:
    """ENG-10: prompts and sampling_params of the wrong type are refused before anything is added."""
    llm = make()
    before = llm.engine._arrivals
    with pytest.raises(ValueError, match="prompts"):
        llm.generate(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(PROMPTS, {"temperature": 0.0})  # type: ignore[arg-type]
    assert llm.engine._arrivals == before and not llm.has_unfinished_requests()
    assert tokens(llm, SamplingParams(temperature=0.0, max_tokens=3)) == tokens(
        make(), SamplingParams(temperature=0.0, max_tokens=3))


@pytest.mark.clause("ENG-11")
def test_a_failure_outside_the_model_makes_the_engine_refuse_further_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """ENG-11: after an exception inside a step that the model did not raise, every later call is refused."""
    llm = make()

    def broken(*args: Any) -> list[int]:
        raise KeyError("a bug in the step's bookkeeping")

    monkeypatch.setattr(llm.engine, "_count", broken)
    with pytest.raises(KeyError):
        llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    monkeypatch.undo()
    for later in (lambda: llm.generate(PROMPTS, use_tqdm=False), lambda: llm.add_request([1, 2, 3]),
                  llm.step, lambda: llm.abort(0)):
        with pytest.raises(RuntimeError, match="make a new LLM"):
            later()


@pytest.mark.clause("ENG-24")
def test_run_command_refuses_bad_arguments_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """ENG-24: `nanoverify run` names the bad argument and exits 2, no traceback."""
    assert cli_main(["run", "--max-input-len", "1"]) == 2
    err = capsys.readouterr().err
    assert "max-input-len" in err and "Traceback" not in err


@pytest.mark.clause("CONF-6")
def test_a_workload_cannot_ask_for_an_unbounded_cache() -> None:
    """CONF-6: a replayed workload's num_blocks is bounded, so one input line cannot exhaust memory."""
    workload = {"config": {"block_size": 4, "num_blocks": 1 << 21, "max_num_seqs": 1, "max_num_batched_tokens": 8,
                           "eos": 0}, "requests": []}
    with pytest.raises(WorkloadError, match=r"config\.num_blocks"):
        parse_workload(workload)
