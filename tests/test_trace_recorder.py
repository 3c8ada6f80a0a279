"""The recorder's edges (TRACE-1, TRACE-4): a closed or broken trace refuses a change before it begins, closing
closes whatever raised on the way, and nothing is written that the reader would refuse."""

from __future__ import annotations

import io
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from optimized import SamplingParams
from optimized.trace.recorder import Recorder
from reference import SchedulerConfig
from tests.engine_fixtures import make_llm

pytestmark = pytest.mark.usefixtures("engine_env")

make = partial(make_llm, num_kvcache_blocks=12, max_num_batched_tokens=10, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


@pytest.mark.clause("TRACE-1")
def test_a_closed_or_broken_trace_refuses_the_next_change_before_it_begins(tmp_path: Path) -> None:
    """TRACE-1: after close(), generate, add_request, step and abort are refused with an error naming the closed
    trace, and nothing is added (the engine stays trusted, the file unchanged); a trace whose write failed refuses
    the next change the same way, with the write's error."""
    path = tmp_path / "t.jsonl"
    llm = make(trace=path)
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    live = llm.add_request([4, 5, 6], GREEDY)
    llm.close()
    written = path.read_bytes()
    for call in (lambda: llm.generate([[7, 8]], GREEDY, use_tqdm=False), lambda: llm.add_request([7, 8], GREEDY),
                 llm.step, lambda: llm.abort(live)):
        with pytest.raises(RuntimeError, match=f"the trace {path} was closed"):
            call()
    assert llm.engine.trusted and llm.interrupted is None
    assert list(llm.engine.by_arrival) == [live] and len(llm.engine.scheduler.waiting) == 1
    assert path.read_bytes() == written

    broken = make(trace=tmp_path / "b.jsonl")
    assert broken.engine.recorder is not None
    broken.engine.recorder.broken = "OSError: No space left on device"
    with pytest.raises(OSError, match="the trace is incomplete since an earlier write failed"):
        broken.add_request([1, 2], GREEDY)
    assert broken.engine.trusted and not broken.engine.by_arrival and not broken.has_unfinished_requests()


class FlushFails:
    """A file whose flush raises; closing goes to the real file."""

    def __init__(self, real: Any) -> None:
        self.real = real

    @property
    def closed(self) -> bool:
        return bool(self.real.closed)

    def flush(self) -> None:
        raise OSError(5, "Input/output error")


@pytest.mark.clause("TRACE-1")
def test_closing_closes_even_when_flushing_or_stopping_workers_raises(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TRACE-1: Recorder.close() closes its file though the flush raised; LLM.close() closes the trace though
    stopping the tensor-parallel workers raised."""
    rec = Recorder(tmp_path / "r.jsonl", SchedulerConfig(num_blocks=4, block_size=4))
    real = rec.file
    rec.file = FlushFails(real)  # type: ignore[assignment]
    with pytest.raises(OSError, match="Input/output error"):
        rec.close()
    assert real.closed and rec.closed
    rec.close()  # again: nothing to do

    llm = make(trace=tmp_path / "l.jsonl")
    from optimized.parallel import launch

    def stop_fails(runner: Any) -> None:
        raise RuntimeError("a worker would not stop")

    monkeypatch.setattr(launch, "close", stop_fails)
    with pytest.raises(RuntimeError, match="a worker would not stop"):
        llm.close()
    assert llm.engine.recorder is not None and llm.engine.recorder.file.closed


def test_an_unused_stream_recorder() -> None:
    """A recorder over a stream the caller owns: close() flushes and leaves it open."""
    out = io.StringIO()
    rec = Recorder(out, SchedulerConfig(num_blocks=4, block_size=4))
    rec.close()
    assert not out.closed and out.getvalue().startswith('{"version": 1')
