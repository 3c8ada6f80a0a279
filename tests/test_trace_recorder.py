"""The recorder's edges (TRACE-1, TRACE-4): a closed or broken trace refuses a change before it begins, closing
closes whatever raised on the way, and nothing is written that the reader would refuse."""

from __future__ import annotations

import io
import json
import os
import re
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from optimized import SamplingParams
from optimized.trace.recorder import Recorder
from optimized.trace.schema import TraceError, read_trace
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
    assert broken.recorder is not None
    broken.recorder.broken = "OSError: No space left on device"
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
    assert llm.recorder is not None and llm.recorder.file.closed


def test_an_unused_stream_recorder() -> None:
    """A recorder over a stream the caller owns: close() flushes and leaves it open."""
    out = io.StringIO()
    rec = Recorder(out, SchedulerConfig(num_blocks=4, block_size=4))
    rec.close()
    assert not out.closed and out.getvalue().startswith('{"version": 2')


@pytest.mark.clause("TRACE-2")
def test_a_step_line_grows_with_the_blocks_added_not_with_the_tables() -> None:
    """TRACE-2: version 2 writes a batch entry's table as [kept, added] against the request's last recorded one: a
    decode step of four 100-block tables is a short line; the reader rebuilds the whole tables."""
    out = io.StringIO()
    rec = Recorder(out, SchedulerConfig(num_blocks=1024, block_size=4))
    tables = {rid: list(range(100 * rid, 100 * rid + 100)) for rid in range(4)}
    for rid in tables:
        rec.add(rid, [1, 2, 3], 8, True)
    rec.step(rec.decided(True, [(rid, 3, t) for rid, t in tables.items()], []), [5] * 4, [])
    tables[2] = [*tables[2], 900]  # request 2 opens a block
    rec.step(rec.decided(False, [(rid, 1, t) for rid, t in tables.items()], []), [6] * 4, [])
    decode = out.getvalue().splitlines()[-1]
    assert len(decode) < 150, decode
    assert '"batch":[[0,1,100,[]],[1,1,100,[]],[2,1,100,[900]],[3,1,100,[]]]' in decode
    trace = read_trace(out.getvalue().encode().splitlines(keepends=True))
    assert [dict((i, t) for i, _, t in s.batch) for s in trace.steps][-1] == tables


@pytest.mark.clause("TRACE-2", "TRACE-4")
def test_version_1_traces_still_replay(tmp_path: Path) -> None:
    """TRACE-2, TRACE-4: a figure's trace rewritten with whole tables under a version-1 header reads to the same
    steps and replays identically; a version-2 entry keeping more blocks than were recorded is refused by line."""
    from optimized.trace.figures import FIGURES
    from optimized.trace.replay import replay_trace
    from optimized.trace.workload import record_workload

    text = record_workload(FIGURES["preemption"].workload())
    v2 = read_trace(text.encode().splitlines(keepends=True))
    records = [json.loads(line) for line in text.splitlines()]
    records[0]["version"] = 1
    steps = iter(v2.steps)
    for record in records[1:]:
        if "batch" in record:
            record["batch"] = [[i, n, t] for i, n, t in next(steps).batch]
    v1 = read_trace([(json.dumps(r) + "\n").encode() for r in records])
    assert v1.steps == v2.steps
    assert all(replay_trace(v1, impl).ok for impl in ("reference", "optimized"))
    lines = text.splitlines(keepends=True)
    lines[6] = lines[6].replace("[0,1,2,[]]", "[0,1,3,[]]")  # step 1 keeps 3 of request 0's 2 recorded blocks
    with pytest.raises(TraceError, match=r"^line 7: batch\[0\]\[2\]: keeps 3 blocks of a last recorded table of 2$"):
        read_trace([line.encode() for line in lines])


@pytest.mark.clause("TRACE-4")
def test_the_recorder_refuses_a_line_the_reader_would_refuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TRACE-4: the reader refuses a line over 1 MiB; the recorder never writes one: an add record that long
    refuses the request at the door (ValueError, nothing added, the engine trusted), a step record that long is a
    write that failed (ValueError naming the limit, nothing written, every later write refused)."""
    from optimized.cli.replay import read_input
    from optimized.verify.conformance import MAX_LINE_BYTES

    path = tmp_path / "long.jsonl"
    long_add = json.dumps({"add": {"id": 0, "prompt": [123456] * 150_000, "max_tokens": 1, "ignore_eos": False,
                                   "arrive": 0}})
    assert len(long_add) > MAX_LINE_BYTES
    path.write_text(json.dumps({"version": 2, "config": {"block_size": 4, "num_blocks": 8, "max_num_seqs": 2,
                                                         "max_num_batched_tokens": 8, "eos": 0}}) + "\n" + long_add)
    with pytest.raises(TraceError, match=f"^line 2: longer than {MAX_LINE_BYTES} bytes$"):
        read_input(str(path))

    out = io.StringIO()
    rec = Recorder(out, SchedulerConfig(num_blocks=1 << 20, block_size=4))
    with pytest.raises(ValueError, match=f"past the trace reader's {MAX_LINE_BYTES}-byte line limit"):
        rec.add(0, [123456] * 150_000, 1, False)
    rec.add(0, [1, 2, 3], 1, False)  # refused, not broken: the next add is written
    before = out.getvalue()
    huge = [(rid, 1, list(range(rid * 4096, rid * 4096 + 4096))) for rid in range(64)]  # 256k new blocks
    with pytest.raises(ValueError, match=f"cannot record step 0: its line would be .* past the trace reader's "
                                         f"{MAX_LINE_BYTES}-byte line limit"):
        rec.step(rec.decided(True, huge, []), [5] * 64, [])
    assert out.getvalue() == before and rec.broken is not None
    with pytest.raises(OSError, match="the trace is incomplete since an earlier write failed"):
        rec.step(rec.decided(True, [(0, 3, [0])], []), [5], [])

    import optimized.trace.recorder as recorder_module

    monkeypatch.setattr(recorder_module, "MAX_LINE_BYTES", 200)
    llm = make(trace=tmp_path / "t.jsonl")
    with pytest.raises(ValueError, match="past the trace reader's 200-byte line limit"):
        llm.add_request([200 + k % 50 for k in range(30)], GREEDY)
    assert llm.engine.trusted and not llm.engine.by_arrival and not llm.has_unfinished_requests()
    assert llm.generate([[1, 2]], GREEDY, use_tqdm=False)[0].token_ids


@pytest.mark.clause("TRACE-1")
def test_a_trace_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """TRACE-1: a trace in a missing folder, a folder, or a file without write permission is a ValueError naming
    it, raised before any model loads."""
    import optimized.entry.build as build_module
    from optimized import LLM

    def no_load(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model loaded")

    monkeypatch.setattr(build_module, "load_config", no_load)
    locked = tmp_path / "locked.jsonl"
    locked.write_text("")
    locked.chmod(0o444)
    for path, why in ((tmp_path / "missing" / "t.jsonl", "does not exist"), (tmp_path, "is a folder"),
                      (locked, "cannot be written")):
        if why == "cannot be written" and os.access(locked, os.W_OK):  # root writes anyway: nothing to refuse
            continue
        with pytest.raises(ValueError, match=f"trace '{re.escape(str(path))}'.*{why}"):
            LLM(trace=path)


def test_a_recorder_steps_forward_only() -> None:
    rec = Recorder(io.StringIO(), SchedulerConfig(num_blocks=4, block_size=4))
    rec.at_step(3)
    with pytest.raises(ValueError, match="step 2 is before step 3"):
        rec.at_step(2)
