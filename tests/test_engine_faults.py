"""A model runner that raises mid-step (spec/abort.md FAULT-1..3, beyond the lesson), all in check mode; and any
other exception anywhere in a step, an add or an abort (FAULT-4, FAULT-5), a KeyboardInterrupt among them.

The fault is injected by replacing the runner's ``run``: on its k-th call it
runs the real forward (so the batch's KV is written), overwrites every slot
this step wrote with garbage, and raises. Had the engine registered the failed
step's blocks in the prefix cache, a later request with the same prompt would
attend to that garbage and its greedy tokens would differ from a fresh
engine's; the tests compare them token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import pytest
import torch

from invariants import check_state, snapshot
from optimized import LLM, RequestOutput, SamplingParams
from tests.engine_fixtures import make_llm

pytestmark = pytest.mark.usefixtures("engine_env")


GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PROMPTS = [list(range(10, 19)), [7, 8, 9], list(range(30, 40))]


class ModelFault(RuntimeError):
    pass


make = partial(make_llm, num_kvcache_blocks=16)


def fresh(prompts: list[list[int]], **kwargs: Any) -> list[list[int]]:
    return [o.token_ids for o in make(**kwargs).generate(prompts, GREEDY, use_tqdm=False)]


def fail_on_call(monkeypatch: pytest.MonkeyPatch, llm: LLM, k: int) -> list[list[int]]:
    """Make the k-th runner call (1-based) write garbage KV and raise; the arrivals of each failed batch."""
    runner = llm.engine.runner
    real = runner.run
    calls = [0]
    failed: list[list[int]] = []

    def run(seqs: Sequence[Any], is_prefill: bool, draws: Sequence[Any]) -> list[int]:
        calls[0] += 1
        tokens: list[int] = real(seqs, is_prefill, draws)
        if calls[0] != k:
            return tokens
        for seq in seqs:  # the slots this step wrote
            for pos in range(seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens):
                block, offset = seq.block_table[pos // runner.block_size], pos % runner.block_size
                runner.kv_cache[:, :, block, offset] = torch.randn_like(runner.kv_cache[:, :, block, offset]) * 50
        failed.append([r.arrival for s in seqs for r in [llm.engine.live[s.seq_id]]])
        raise ModelFault(f"injected fault on runner call {k}")

    monkeypatch.setattr(runner, "run", run)
    return failed


def consistent(llm: LLM, idle: bool = False) -> None:
    """FAULT-2: every invariant on both schedulers; when idle, no block used and the shadow empty too."""
    assert llm.shadow is not None
    for sched in (llm.engine.scheduler, llm.shadow.ref):
        state = snapshot(sched)
        assert check_state(state) == []
        if idle:
            assert state.used_block_ids == set()
    if idle:
        assert llm.engine.live == {} and llm.shadow.by_arrival == {}


def drain(llm: LLM) -> dict[int, RequestOutput]:
    outputs: dict[int, RequestOutput] = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert out.request_id not in outputs
            outputs[out.request_id] = out
    return outputs


# (failing call, tokens request 0 had): the first prefill; a decode after request 2's own prefill
@pytest.mark.clause("FAULT-1", "FAULT-2")
@pytest.mark.parametrize(("k", "had"), [(1, 0), (3, 1)])
def test_a_failed_step_errors_its_batch_and_the_rest_is_served(monkeypatch: pytest.MonkeyPatch, k: int,
                                                                had: int) -> None:
    """FAULT-1, FAULT-2: the exception reaches step()'s caller; the failed batch's requests finish with "error"
    (returned by the next step()); the request not in the batch, and a new one, are served with exact tokens."""
    llm = make(max_num_seqs=2)  # the third request waits outside the batch
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    failed = fail_on_call(monkeypatch, llm, k)
    outputs: dict[int, RequestOutput] = {}
    with pytest.raises(ModelFault):
        while True:
            outputs.update((o.request_id, o) for o in llm.step())
    assert failed == [[0, 1]] and llm.engine.stats.failed_steps == 1
    consistent(llm)
    late = llm.add_request(PROMPTS[0], GREEDY)
    outputs.update(drain(llm))
    assert sorted(outputs) == [*ids, late]
    assert [outputs[i].finish_reason for i in ids] == ["error", "error", "length"]
    assert len(outputs[0].token_ids) == had  # what it had before the failed step
    assert [outputs[2].token_ids, outputs[late].token_ids] == fresh([PROMPTS[2], PROMPTS[0]])
    consistent(llm, idle=True)
    assert llm.engine.stats.compared_steps == llm.engine.stats.steps


@pytest.mark.clause("FAULT-2")
def test_a_failed_chunk_is_not_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    """FAULT-2: the second chunk of a prefill fails; only the first chunk's blocks stay cached, and a request with
    the same prompt afterwards hits exactly those and generates exact tokens."""
    llm = make(max_num_batched_tokens=6)
    long = list(range(40, 54))
    first = llm.add_request(long, GREEDY)
    fail_on_call(monkeypatch, llm, 2)
    assert llm.step() == []
    with pytest.raises(ModelFault):
        llm.step()
    consistent(llm, idle=True)
    hits = llm.engine.stats.prefix_cache_hit_tokens
    again = llm.add_request(long, GREEDY)
    outputs = drain(llm)
    assert outputs[first].finish_reason == "error" and outputs[first].token_ids == []
    assert llm.engine.stats.prefix_cache_hit_tokens == hits + 4  # block 0, filled by the first chunk
    assert outputs[again].token_ids == fresh([long])[0]
    consistent(llm, idle=True)


@pytest.mark.clause("FAULT-3")
@pytest.mark.parametrize("k", [1, 4])
def test_generate_is_reusable_after_a_fault(monkeypatch: pytest.MonkeyPatch, k: int) -> None:
    """FAULT-3: generate() re-raises, having aborted its own requests: the engine is idle, no block leaks, and the
    next generate() (same prompts, so the prefix cache is in play) equals a fresh engine's, token for token."""
    llm = make(num_kvcache_blocks=8)  # small enough that decode preempts
    fail_on_call(monkeypatch, llm, k)
    with pytest.raises(ModelFault):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not llm.has_unfinished_requests()
    consistent(llm, idle=True)
    monkeypatch.undo()
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == fresh(PROMPTS, num_kvcache_blocks=8)
    consistent(llm, idle=True)
    assert llm.engine.stats.compared_steps == llm.engine.stats.steps


@pytest.mark.clause("FAULT-1", "FAULT-3")
def test_a_fault_in_generate_keeps_add_request_work_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    """FAULT-1, FAULT-3: a request added with add_request before generate() and outside the failed batch stays
    queued through the fault and is served afterwards with exact tokens."""
    llm = make(max_num_seqs=1)
    pending = llm.add_request(PROMPTS[1], GREEDY)
    failed = fail_on_call(monkeypatch, llm, 2)  # call 1 prefills `pending`, call 2 prefills generate's first
    with pytest.raises(ModelFault):
        llm.generate([PROMPTS[0], PROMPTS[2]], GREEDY, use_tqdm=False)
    assert failed == [[1]]
    consistent(llm)
    assert llm.has_unfinished_requests()
    outputs = drain(llm)
    assert sorted(outputs) == [pending] and outputs[pending].token_ids == fresh([PROMPTS[1]])[0]
    consistent(llm, idle=True)


@pytest.mark.clause("FAULT-3")
def test_an_error_outside_the_model_is_not_cleaned_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """FAULT-3: only model faults are handled; an exception from postprocess leaves the step unfinished and
    reaches the caller as itself, with no cleanup attempted over the untrusted state."""
    llm = make()

    def broken(*args: Any) -> None:
        raise KeyError("postprocess bug")

    monkeypatch.setattr(llm.engine.scheduler, "postprocess", broken)
    with pytest.raises(KeyError, match="postprocess bug"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.in_step and len(llm.engine.live) == len(PROMPTS)
    assert llm.engine.stats.aborted_requests == 0 and llm.engine.stats.failed_steps == 0


@pytest.mark.clause("ABORT-7", "FAULT-1")
def test_outputs_waiting_for_step_survive_a_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    """ABORT-7, FAULT-1: an add_request output that finished while generate() ran waits for step(); a failed
    step() loses neither it nor the failed request's "error" output."""
    llm = make()
    early = llm.add_request(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=1))
    mine = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
    assert [o.request_id for o in mine] == [1] and llm.has_unfinished_requests()
    doomed = llm.add_request(PROMPTS[2], GREEDY)
    fail_on_call(monkeypatch, llm, 1)
    with pytest.raises(ModelFault):
        llm.step()
    outputs = drain(llm)
    assert sorted(outputs) == [early, doomed]
    assert outputs[early].finish_reason == "length" and len(outputs[early].token_ids) == 1
    assert outputs[doomed].finish_reason == "error"
    consistent(llm, idle=True)


# --- FAULT-4, FAULT-5: an exception anywhere in a step ----------------------------------------------------------

class Bug(Exception):
    """A plain exception standing for a bug at the injection point."""


def raise_on_call(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, k: int, error: type[BaseException],
                  after: bool) -> None:
    """Make ``owner.name``'s k-th call (1-based) raise ``error``: before the real call, or after it changed state."""
    real = getattr(owner, name)
    calls = [0]

    def wrapped(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] != k:
            return real(*args)
        if not after:
            raise error(f"injected into {name}")
        real(*args)
        raise error(f"injected after {name}")

    monkeypatch.setattr(owner, name, wrapped)


# Where a step is hit: (the object, its attribute, after the real call?); the model's run is a handled fault.
POINTS: dict[str, tuple[str, str, bool]] = {
    "schedule before it mutates": ("scheduler", "schedule", False),
    "schedule after it mutated": ("scheduler", "schedule", True),
    "postprocess before": ("scheduler", "postprocess", False),
    "postprocess after": ("scheduler", "postprocess", True),
    "the shadow's schedule": ("shadow_ref", "schedule", True),
    "the shadow after postprocess": ("shadow", "after_postprocess", True),
    "the model": ("runner", "run", False),
}


def owner_of(llm: LLM, where: str) -> Any:
    shadow = llm.shadow
    assert shadow is not None
    return {"scheduler": llm.engine.scheduler, "shadow": shadow, "shadow_ref": shadow.ref,
            "runner": llm.engine.runner}[where]


def refuses_further_use(llm: LLM, cause: str) -> None:
    """ENG-11: every later call raises a RuntimeError that says what failed and to make a new LLM."""
    for later in (lambda: llm.generate(PROMPTS, GREEDY, use_tqdm=False), lambda: llm.add_request([1, 2, 3], GREEDY),
                  llm.step, lambda: llm.abort(0)):
        with pytest.raises(RuntimeError, match=f"(?s)make a new LLM.*{cause}|{cause}.*make a new LLM"):
            later()


@pytest.mark.clause("FAULT-4", "ENG-11")
@pytest.mark.parametrize("api", ["generate", "step"])
@pytest.mark.parametrize("error", [KeyboardInterrupt, Bug])
@pytest.mark.parametrize("point", sorted(POINTS))
def test_an_exception_anywhere_in_a_step_propagates_and_leaves_no_half_state(
        monkeypatch: pytest.MonkeyPatch, point: str, error: type[BaseException], api: str) -> None:
    """FAULT-4: the second step is hit at ``point``; the original exception reaches the caller as itself (a
    KeyboardInterrupt stays one), and the engine is either consistent (the model: the batch failed, generate's
    requests aborted, every block free, the next generate exact) or refuses further use, naming the exception."""
    where, name, after = POINTS[point]
    llm = make(max_num_seqs=2)
    raise_on_call(monkeypatch, owner_of(llm, where), name, 2, error, after)
    with pytest.raises(error) as caught:
        if api == "generate":
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        else:
            for p in PROMPTS:
                llm.add_request(p, GREEDY)
            while True:
                llm.step()
    assert type(caught.value) is error and "injected" in str(caught.value)
    monkeypatch.undo()
    if where != "runner":
        refuses_further_use(llm, error.__name__)
        return
    outputs = drain(llm)
    assert all(o.finish_reason in ("error", "length") for o in outputs.values())
    consistent(llm, idle=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == fresh(PROMPTS, max_num_seqs=2)
    consistent(llm, idle=True)


@pytest.mark.clause("FAULT-5", "ENG-11")
@pytest.mark.parametrize(("first", "then"), [(ModelFault, KeyboardInterrupt), (KeyboardInterrupt, Bug)])
def test_a_cleanup_that_fails_never_masks_the_fault(monkeypatch: pytest.MonkeyPatch, first: type[BaseException],
                                                    then: type[BaseException]) -> None:
    """FAULT-5: the model raises and then failing its batch raises too: the model's exception propagates (a
    note names the second), and the engine refuses further use."""
    llm = make()
    raise_on_call(monkeypatch, llm.engine.runner, "run", 2, first, False)
    raise_on_call(monkeypatch, llm.engine.scheduler, "abort_step", 1, then, False)
    with pytest.raises(first) as caught:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert "injected into run" in str(caught.value)
    assert any(then.__name__ in note for note in getattr(caught.value, "__notes__", []))
    monkeypatch.undo()
    refuses_further_use(llm, first.__name__)


@pytest.mark.clause("FAULT-5", "ENG-11")
def test_generate_cleanup_that_fails_never_masks_the_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    """FAULT-5: the model raises a KeyboardInterrupt and aborting generate's own requests afterwards raises: the
    KeyboardInterrupt propagates, and the engine refuses further use, naming what broke it in the abort."""
    llm = make(max_num_seqs=2)  # the second runner call prefills request 2 alone: 0 and 1 stay live
    raise_on_call(monkeypatch, llm.engine.runner, "run", 2, KeyboardInterrupt, False)
    raise_on_call(monkeypatch, llm.engine.scheduler, "abort", 1, Bug, True)
    with pytest.raises(KeyboardInterrupt) as caught:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert any("Bug" in note for note in getattr(caught.value, "__notes__", []))
    monkeypatch.undo()
    refuses_further_use(llm, "Bug: injected after abort")


@pytest.mark.clause("FAULT-4", "ENG-11")
@pytest.mark.parametrize("error", [KeyboardInterrupt, Bug])
@pytest.mark.parametrize("operation", ["add", "abort"])
def test_an_exception_half_way_through_an_add_or_an_abort_leaves_the_engine_refusing(
        monkeypatch: pytest.MonkeyPatch, operation: str, error: type[BaseException]) -> None:
    """FAULT-4: the shadow raises after the engine's scheduler already took (or released) the request: the
    exception propagates as itself and the engine refuses further use, naming the add or the abort."""
    llm = make()
    shadow = llm.shadow
    assert shadow is not None
    if operation == "abort":
        llm.add_request(PROMPTS[0], GREEDY)
    raise_on_call(monkeypatch, shadow, operation, 1, error, True)
    with pytest.raises(error):
        if operation == "add":
            llm.add_request(PROMPTS[0], GREEDY)
        else:
            llm.abort(0)
    monkeypatch.undo()
    refuses_further_use(llm, error.__name__)
    with pytest.raises(RuntimeError, match=f"inside an {operation}"):
        llm.step()


class Unprintable(Exception):
    def __str__(self) -> str:
        raise ValueError("no message for you")


@pytest.mark.clause("FAULT-5", "ENG-11")
def test_an_exception_that_cannot_be_printed_still_propagates_as_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """FAULT-5: recording why the engine is broken never raises over the original exception, even when its str()
    raises; the refusal then names its type."""
    llm = make()
    raise_on_call(monkeypatch, llm.engine.scheduler, "postprocess", 1, Unprintable, True)
    with pytest.raises(Unprintable):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    refuses_further_use(llm, "Unprintable")


class InterruptOnce:
    """A callable that raises KeyboardInterrupt on its first call and otherwise calls ``wrapped``."""

    def __init__(self, wrapped: Any) -> None:
        self.wrapped, self.fired = wrapped, False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.fired:
            self.fired = True
            raise KeyboardInterrupt("in the LLM's bookkeeping")
        return self.wrapped(*args, **kwargs)


class InterruptingIds(dict[int, Any]):
    """The LLM's map of issued add_request ids, interrupted while an id is recorded."""

    def __setitem__(self, key: int, value: Any) -> None:
        raise KeyboardInterrupt("in the LLM's bookkeeping")


@pytest.mark.clause("FAULT-6", "ENG-11")
@pytest.mark.parametrize("where", ["add_request", "step", "generate", "abort"])
def test_an_interrupt_in_the_llms_bookkeeping_leaves_it_refusing(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """FAULT-6: after the engine did its part, an interrupt before the LLM recorded the id or handed the outputs
    over propagates as itself, and every later call refuses, naming the interrupted bookkeeping."""
    llm = make()
    if where == "add_request":
        monkeypatch.setattr(llm, "_stepped", InterruptingIds())
        call: Any = lambda: llm.add_request([1, 2, 3], GREEDY)  # noqa: E731
        what = "an add_request"
    elif where == "abort":
        rid = llm.add_request([1, 2, 3], GREEDY)
        monkeypatch.setattr(llm, "_output", InterruptOnce(llm._output))
        call, what = (lambda: llm.abort(rid)), "an abort"
    else:
        monkeypatch.setattr(llm, "_deliver", InterruptOnce(llm._deliver))
        if where == "step":
            llm.add_request([1, 2, 3], GREEDY)
            call = llm.step
        else:
            call = lambda: llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # noqa: E731
        what = "a step"
    with pytest.raises(KeyboardInterrupt, match="in the LLM's bookkeeping"):
        call()
    assert llm.engine.trusted  # the engine itself is consistent: the loss would be the LLM's
    refuses_further_use(llm, f"interrupted during {what}")


@pytest.mark.clause("FAULT-6", "ABORT-8")
def test_a_refused_abort_is_not_an_interrupted_bookkeeping() -> None:
    """FAULT-6: an abort refused for an id never issued changes nothing; the LLM stays usable."""
    llm = make()
    for bad in (7, -1, "0"):
        with pytest.raises(ValueError, match="request_id"):
            llm.abort(bad)  # type: ignore[arg-type]
    assert llm.interrupted is None and len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == len(PROMPTS)


@pytest.mark.clause("FAULT-6", "FAULT-1", "FAULT-3")
def test_a_model_fault_is_not_an_interrupted_bookkeeping(monkeypatch: pytest.MonkeyPatch) -> None:
    """FAULT-6: a model fault the engine recovered from leaves the LLM usable (FAULT-1 and FAULT-3 hold)."""
    llm = make()
    runner = llm.engine.runner
    monkeypatch.setattr(runner, "run", InterruptOnce(runner.run))
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.interrupted is None
    assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == len(PROMPTS)


@pytest.mark.clause("FAULT-6", "THREAD-2")
def test_another_callers_interruption_is_not_hidden_by_a_later_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """FAULT-6: while a generate call is between its steps, another caller's step is interrupted in its bookkeeping
    (its add_request output is lost); the generate call's next step must refuse, not clear the mark and go on."""
    import tqdm

    llm = make()
    llm.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=1))
    real_update, real_deliver = tqdm.tqdm.update, llm._deliver
    fired: list[bool] = []

    def other_caller_between_steps(bar: Any, n: float = 1) -> Any:
        if not fired:  # generate holds no lock while it updates its bar: "another thread" steps now
            fired.append(True)
            monkeypatch.setattr(llm, "_deliver", InterruptOnce(real_deliver))
            with pytest.raises(KeyboardInterrupt):
                llm.step()
        return real_update(bar, n)

    monkeypatch.setattr(tqdm.tqdm, "update", other_caller_between_steps)
    with pytest.raises(RuntimeError, match="interrupted during a step"):
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert llm.interrupted == "a step"
    refuses_further_use(llm, "interrupted during a step")
