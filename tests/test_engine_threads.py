"""One LLM called from several threads at once (spec/abort.md THREAD-, beyond the lesson), all in check mode.

Threads run under a tiny switch interval (``sys.setswitchinterval(1e-6)``),
so the interpreter switches threads between almost any two bytecodes; each
thread's outputs are compared with what the same calls give alone on a fresh
engine (greedy, or seeded: both are independent of batching), and afterwards
no request is live and every KV block is free in both schedulers.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest

from invariants import check_state, snapshot
from optimized import LLM, RequestOutput, SamplingParams
from tests.engine_fixtures import make_llm

pytestmark = pytest.mark.usefixtures("engine_env")


GREEDY = SamplingParams(temperature=0.0, max_tokens=5)
SEEDED = SamplingParams(temperature=0.8, max_tokens=5, seed=7)
JOBS = [
    ([list(range(10, 19)), [7, 8, 9]], GREEDY),
    ([list(range(30, 40)), [3, 4]], SEEDED),
    ([list(range(10, 19)), [50, 51, 52, 53]], GREEDY),  # shares a prefix with the first job
    ([[90, 91], list(range(60, 66))], SEEDED),
]


make = partial(make_llm, num_kvcache_blocks=24)


def alone(prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.token_ids for o in make().generate(prompts, params, use_tqdm=False)]


def run_threads(work: list[Callable[[], None]]) -> None:
    """Run each callable in its own thread under a 1 us switch interval; re-raise the first error of any."""
    errors: list[BaseException] = []

    def guarded(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as e:  # reported to the test below
            errors.append(e)

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=guarded, args=(job,)) for job in work]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a thread hung"
    finally:
        sys.setswitchinterval(before)
    if errors:
        raise errors[0]


def assert_idle(llm: LLM, failed_steps: int = 0) -> None:
    """No live request, every block free and every invariant, in the engine and in its shadow."""
    assert llm.shadow is not None
    for sched in (llm.engine.scheduler, llm.shadow.ref):
        state = snapshot(sched)
        assert check_state(state) == [] and state.used_block_ids == set()
    assert llm.engine.live == {} and llm.shadow.by_arrival == {}
    assert not llm.has_unfinished_requests()
    assert llm.engine.stats.compared_steps == llm.engine.stats.steps and llm.engine.stats.failed_steps == failed_steps


@pytest.mark.clause("THREAD-1", "THREAD-2")
@pytest.mark.parametrize("threads", [2, 4])
def test_generate_from_several_threads(threads: int) -> None:
    """THREAD-1, THREAD-2: concurrent generate() calls on one LLM each return exactly their own outputs, as they
    would alone; nothing fails, and the engine is idle with every block free afterwards."""
    jobs = JOBS[:threads]
    expected = [alone(prompts, params) for prompts, params in jobs]
    llm = make()
    got: dict[int, list[RequestOutput]] = {}

    def call(i: int) -> Callable[[], None]:
        return lambda: got.__setitem__(i, llm.generate(jobs[i][0], jobs[i][1], use_tqdm=False))

    run_threads([call(i) for i in range(threads)])
    assert [[o.token_ids for o in got[i]] for i in range(threads)] == expected
    for i, (prompts, _) in enumerate(jobs):
        assert [o.prompt_token_ids for o in got[i]] == prompts
    ids = [o.request_id for i in range(threads) for o in got[i]]
    assert sorted(ids) == list(range(2 * threads))
    assert_idle(llm)


@pytest.mark.clause("THREAD-1", "THREAD-2", "ABORT-7")
def test_step_loop_with_adds_aborts_and_a_generate_from_other_threads() -> None:
    """THREAD-1, THREAD-2, ABORT-7: one thread adds and aborts requests while another loops on step() and a third
    calls generate(); every add_request output is returned exactly once, by step() or abort(), never to
    generate(), and every finished request has the tokens it has alone."""
    llm = make()
    step_prompts = [list(range(20, 27)), [5, 6, 7, 8], list(range(40, 45))]
    expected_steps = alone(step_prompts, GREEDY)
    expected_gen = alone(*JOBS[1])
    added: list[int] = []
    victims: list[int] = []
    stepped: list[RequestOutput] = []
    aborted: list[RequestOutput] = []
    gen: list[RequestOutput] = []
    adding_done = threading.Event()

    def client() -> None:
        for p in step_prompts:
            added.append(llm.add_request(p, GREEDY))
        victims.append(llm.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=40)))
        out = llm.abort(victims[0])
        aborted.extend([] if out is None else [out])  # None: it finished first, and step() returns it
        adding_done.set()

    def loop() -> None:
        while not adding_done.is_set() or llm.has_unfinished_requests():
            stepped.extend(llm.step())

    def generator() -> None:
        gen.extend(llm.generate(*JOBS[1], use_tqdm=False))

    run_threads([client, loop, generator])
    by_id = {o.request_id: o for o in stepped}
    assert len(by_id) == len(stepped)  # each once
    assert sorted([*by_id, *(o.request_id for o in aborted)]) == sorted(added + victims)  # only add_request ones
    assert [by_id[i].token_ids for i in added] == expected_steps
    assert all(o.finish_reason == "abort" for o in aborted)
    assert [o.token_ids for o in gen] == expected_gen and not set(by_id) & {o.request_id for o in gen}
    assert_idle(llm)


class ModelFault(RuntimeError):
    pass


@pytest.mark.clause("THREAD-2", "FAULT-1", "FAULT-3")
def test_a_model_fault_in_one_threads_step_reaches_that_thread_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """THREAD-2, FAULT-1, FAULT-3: while three threads generate, one runner call raises. Exactly one caller gets
    the exception; every other caller returns all its outputs, those that finished normally with the tokens they
    have alone and those of the failed batch with "error"; afterwards the engine is idle, every block free."""
    llm = make()
    expected = [alone(prompts, params) for prompts, params in JOBS[:3]]
    real = llm.engine.runner.run
    calls = [0]

    def run(*args: Any) -> list[int]:
        calls[0] += 1
        if calls[0] == 4:
            raise ModelFault("injected")
        tokens: list[int] = real(*args)
        return tokens

    monkeypatch.setattr(llm.engine.runner, "run", run)
    got: dict[int, list[RequestOutput]] = {}
    faults: list[int] = []

    def call(i: int) -> Callable[[], None]:
        def job() -> None:
            try:
                got[i] = llm.generate(JOBS[i][0], JOBS[i][1], use_tqdm=False)
            except ModelFault:
                faults.append(i)
        return job

    run_threads([call(i) for i in range(3)])
    assert len(faults) == 1 and sorted([*got, *faults]) == [0, 1, 2]
    for i, outputs in got.items():
        for out, tokens in zip(outputs, expected[i], strict=True):
            assert out.finish_reason == "error" or out.token_ids == tokens
    monkeypatch.undo()
    assert_idle(llm, failed_steps=1)
