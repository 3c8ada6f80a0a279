"""ARCH-3: the engine tells its observers every change, in order, and knows them only through ``StepObserver``."""

from __future__ import annotations

import ast
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from optimized import SamplingParams
from optimized.engine.observer import StepObserver
from optimized.trace.cost import TimedObserver
from optimized.trace.recorder import TraceObserver
from optimized.verify.shadow import Shadow, ShadowDivergence
from tests.engine_fixtures import make_llm

pytestmark = pytest.mark.usefixtures("engine_env")
ROOT = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


class Log:
    """A StepObserver that writes down what it is told, as (hook, arrivals) pairs."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, tuple[int, ...]]] = []

    def before_change(self) -> None:
        pass

    def check_add(self, token_ids: Sequence[int], params: Any) -> None:
        self.seen.append(("check_add", (len(token_ids),)))

    def added(self, request: Any) -> None:
        self.seen.append(("added", (request.arrival,)))

    def scheduled(self, scheduler: Any, out: Any, requests: Sequence[Any], live: Mapping[int, Any]) -> None:
        self.seen.append(("scheduled", tuple(r.arrival for r in requests)))

    def stepped(self, scheduler: Any, tokens: Any, finished: Sequence[Any], start: float) -> None:
        self.seen.append(("stepped", tuple(r.arrival for r in finished)))

    def step_failed(self, fault: BaseException, start: float) -> None:
        self.seen.append(("step_failed", ()))

    def batch_withdrawn(self, scheduler: Any, failed: Sequence[Any], live: Mapping[int, Any]) -> None:
        self.seen.append(("batch_withdrawn", tuple(r.arrival for r in failed)))

    def aborted(self, scheduler: Any, request: Any, live: Mapping[int, Any]) -> None:
        assert request.seq.seq_id not in live  # told after the engine forgot it
        self.seen.append(("aborted", (request.arrival,)))

    def close(self) -> None:
        self.seen.append(("close", ()))


def _observer(log: Log) -> StepObserver:
    return log  # mypy checks here that Log satisfies the protocol


@pytest.mark.clause("ARCH-3")
def test_an_observer_is_told_every_change_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """ARCH-3: adds, each step's decisions and outcome, an abort and a failed step reach an observer the entry floor
    did not know of, in the order the engine made them; close() reaches it too."""
    llm = make_llm(num_kvcache_blocks=32)
    log = Log()
    llm.engine.observers.append(_observer(log))
    first = llm.add_request([1, 2, 3], GREEDY)
    second = llm.add_request([4, 5], GREEDY)
    llm.step()  # both prefilled
    llm.abort(second)
    runner = llm.engine.runner
    real = runner.run

    def fail(*args: Any) -> Any:
        raise RuntimeError("injected model fault")

    monkeypatch.setattr(runner, "run", fail)
    with pytest.raises(RuntimeError, match="injected model fault"):
        llm.step()
    monkeypatch.setattr(runner, "run", real)
    llm.close()
    assert log.seen == [
        ("check_add", (3,)), ("added", (first,)), ("check_add", (2,)), ("added", (second,)),
        ("scheduled", (first, second)), ("stepped", ()),
        ("aborted", (second,)),
        ("scheduled", (first,)), ("step_failed", ()), ("batch_withdrawn", (first,)),
        ("close", ()),
    ]


@pytest.mark.clause("ARCH-3")
def test_an_observer_refusing_before_a_change_changes_nothing() -> None:
    """ARCH-3: ``before_change`` runs before the change begins: a refusal there leaves no request behind."""
    llm = make_llm(num_kvcache_blocks=32)

    class Refusing(Log):
        def before_change(self) -> None:
            raise OSError("the observer can take nothing more")

    llm.engine.observers.append(Refusing())
    with pytest.raises(OSError, match="nothing more"):
        llm.add_request([1, 2, 3], GREEDY)
    assert llm.engine.live == {} and llm.engine.scheduler.is_finished() and llm.engine.trusted


@pytest.mark.clause("ARCH-3", "TRACE-12")
def test_the_trace_is_told_first_so_a_divergent_step_is_still_on_disk(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """ARCH-3: the entry floor wires the recorder before the shadow; when the shadow finds a step divergent, the
    step it judged is already in the trace. The negative control: wired the other way round, it is not."""
    for recorder_first in (True, False):
        path = tmp_path / f"run-{recorder_first}.jsonl"
        llm = make_llm(num_kvcache_blocks=32, trace=str(path))
        observers = llm.engine.observers
        assert [type(o) for o in observers] == [TraceObserver, Shadow]
        if not recorder_first:
            observers.reverse()
        shadow = llm.shadow
        assert shadow is not None

        def diverge(*args: Any) -> None:
            raise ShadowDivergence("injected by the test")

        monkeypatch.setattr(shadow, "after_postprocess", diverge)
        llm.add_request([1, 2, 3], GREEDY)
        with pytest.raises(ShadowDivergence):
            llm.step()
        steps = [json.loads(line) for line in path.read_text().splitlines() if line.startswith('{"step"')]
        assert len(steps) == (1 if recorder_first else 0), recorder_first


class Slow(Log):
    """A Log whose every hook it writes down takes ``PAUSE`` seconds (not ``before_change``, which the engine calls
    before every change, however many: the floor below counts the hooks written down)."""

    PAUSE = 0.002

    def __getattribute__(self, name: str) -> Any:
        attribute = super().__getattribute__(name)
        if name in StepObserver.__dict__ and name != "before_change" and callable(attribute):
            def slowly(*args: Any) -> Any:
                time.sleep(Slow.PAUSE)
                return attribute(*args)

            return slowly
        return attribute


@pytest.mark.clause("ARCH-3", "TRACE-12")
def test_tracing_is_timed_by_wrapping_its_observer(tmp_path: Path) -> None:
    """ARCH-3, TRACE-12: an observer wrapped in a ``TimedObserver`` is driven by the engine like any other, and the
    time counted is that of every call the engine made into it (each hook of ``Slow`` sleeps a fixed time, so the
    count has a floor); the recorder's observer, wrapped so, still writes the whole trace."""
    llm = make_llm(num_kvcache_blocks=32, trace=str(tmp_path / "t.jsonl"))
    inner = Slow()
    watch = TimedObserver(inner)
    llm.engine.observers[0] = TimedObserver(llm.engine.observers[0])
    llm.engine.observers.append(watch)
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    calls = len(inner.seen)
    assert calls == 8  # check_add, added, then 3 x (scheduled, stepped)
    assert watch.seconds >= calls * Slow.PAUSE
    llm.close()
    assert sum('"step"' in line for line in (tmp_path / "t.jsonl").read_text().splitlines()) == 3


@pytest.mark.clause("ARCH-3", "TRACE-4")
def test_engine_add_asks_every_observer_before_the_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ARCH-3, TRACE-4: ``Engine.add`` (below ``LLM``) asks the observers' ``check_add`` before the add begins: a
    request whose add record the trace reader would refuse is refused, and the engine is unchanged and trusted."""
    import optimized.trace.recorder as recorder_module

    llm = make_llm(num_kvcache_blocks=64, trace=str(tmp_path / "t.jsonl"))
    monkeypatch.setattr(recorder_module, "MAX_LINE_BYTES", 80)
    with pytest.raises(ValueError, match="line limit"):
        llm.engine.add(list(range(1, 40)), GREEDY, 0)
    assert llm.engine.trusted and llm.engine.live == {} and llm.engine.scheduler.is_finished()


@pytest.mark.clause("ARCH-3", "FAULT-5")
def test_an_observer_failing_on_a_fault_never_replaces_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """ARCH-3, FAULT-5: an observer whose ``step_failed`` raises is noted on the model's fault, which propagates as
    itself; the batch is still withdrawn and the engine stays trusted (FAULT-1)."""
    llm = make_llm(num_kvcache_blocks=32)

    class Failing(Log):
        def step_failed(self, fault: BaseException, start: float) -> None:
            raise OSError("the observer broke too")

    after = Log()
    llm.engine.observers += [Failing(), after]
    llm.add_request([1, 2, 3], GREEDY)

    def fail(*args: Any) -> Any:
        raise RuntimeError("injected model fault")

    monkeypatch.setattr(llm.engine.runner, "run", fail)
    with pytest.raises(RuntimeError, match="injected model fault") as raised:
        llm.step()
    assert any("the observer broke too" in note for note in getattr(raised.value, "__notes__", []))
    assert ("step_failed", ()) in after.seen and ("batch_withdrawn", (0,)) in after.seen
    assert llm.engine.trusted and llm.engine.live == {}


@pytest.mark.clause("ARCH-3")
def test_the_engine_names_no_observer() -> None:
    """ARCH-3: the step loop's module imports neither verify/ nor trace/, and names neither the shadow nor the
    recorder (the layers contract forbids the imports; this checks the names too)."""
    source = (ROOT / "optimized/engine/engine.py").read_text()
    names = {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
    assert not names & {"Shadow", "Recorder", "TraceObserver"}
    assert "optimized.verify" not in source and "optimized.trace" not in source
