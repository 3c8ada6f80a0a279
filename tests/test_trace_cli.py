"""Recording from the command line (TRACE-1), a trace that cannot be written (TRACE-4), and the cost bench
(TRACE-12)."""

from __future__ import annotations

import inspect
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from optimized.cli import main
from optimized.trace.cost import order, verdict
from optimized.trace.recorder import Recorder, record_engine_failure, trace_file
from optimized.trace.replay import replay_trace
from optimized.trace.schema import read_trace
from reference import SchedulerConfig
from tests.engine_fixtures import checkpoint

pytestmark = pytest.mark.usefixtures("engine_env")
ROOT = Path(__file__).resolve().parent.parent


def load(path: Path) -> list[int]:
    trace = read_trace(path.read_bytes().splitlines(keepends=True))
    return [replay_trace(trace, impl).identical for impl in ("reference", "optimized")] + [len(trace.steps)]


@pytest.mark.clause("TRACE-1")
def test_run_records_with_trace_flag(tmp_path: Path) -> None:
    """TRACE-1: `nanoverify run --trace FILE`, started as users start it, leaves a trace that replays identically."""
    path = tmp_path / "run.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NANOVERIFY_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "optimized.cli", "run", "--model", str(checkpoint("qwen3")),
                           "--num-requests", "6", "--max-input-len", "12", "--max-output-len", "5",
                           "--num-kvcache-blocks", "10", "--block-size", "4", "--max-num-seqs", "4", "--trace",
                           str(path), "--trace-wall-times"], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert f"trace: {path} (judge it anywhere: nanoverify replay --impl reference {path})" in done.stdout
    identical_ref, identical_opt, steps = load(path)
    assert steps > 0 and identical_ref == identical_opt == steps
    assert '"wall":' in path.read_text()


@pytest.mark.clause("TRACE-1")
def test_generate_records_with_trace_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """TRACE-1: `nanoverify generate --trace FILE`; --trace-wall-times alone is refused naming the flags, as before
    EngineArgs (which names the fields: trace_wall_times needs trace)."""
    path = tmp_path / "gen.jsonl"
    args = ["generate", "--max-tokens", "3"]  # the default model (the tiny checkpoints have no tokenizer)
    assert main([*args, "--trace", str(path), "ab", "cd"]) == 0
    identical_ref, identical_opt, steps = load(path)
    assert steps >= 3 and identical_ref == identical_opt == steps
    capsys.readouterr()
    assert main([*args, "--trace-wall-times", "ab"]) == 2
    assert capsys.readouterr().err.startswith("nanoverify generate: --trace-wall-times needs --trace FILE ")


@pytest.mark.clause("TRACE-1", "ARCH-2")
def test_trace_file_checks_only_the_filesystem(tmp_path: Path) -> None:
    """ARCH-2: trace and trace_wall_times are validated once, by EngineArgs; trace_file (what LLM asks before
    the model loads) takes only the path and judges only whether the file can be written there."""
    assert list(inspect.signature(trace_file).parameters) == ["path"]
    assert trace_file(None) is None and trace_file(str(tmp_path / "t.jsonl")) == tmp_path / "t.jsonl"
    with pytest.raises(ValueError, match="is a folder, not a file"):
        trace_file(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        trace_file(tmp_path / "no" / "t.jsonl")


class FailingStream(io.StringIO):
    def __init__(self, fail_after: int) -> None:
        super().__init__()
        self.writes = fail_after

    def write(self, text: str) -> int:
        self.writes -= 1
        if self.writes < 0:
            raise OSError(28, "No space left on device")
        return super().write(text)


@pytest.mark.clause("TRACE-4")
def test_a_trace_that_cannot_be_written_is_never_silently_incomplete() -> None:
    """TRACE-4: the failed write raises; every later write raises too; a failed step notes it on the fault."""
    config = SchedulerConfig(num_blocks=4, block_size=4)
    rec = Recorder(FailingStream(1), config)
    decided = rec.decided(True, [(0, 3, [0])], [])
    with pytest.raises(OSError, match="No space left"):
        rec.step(decided, [5], [])
    with pytest.raises(OSError, match="the trace is incomplete since an earlier write failed"):
        rec.step(decided, [5], [])
    fault = RuntimeError("model broke")
    rec = Recorder(FailingStream(1), config)
    record_engine_failure(rec, rec.decided(True, [(0, 3, [0])], []), fault, 0.0)  # does not raise
    assert rec.broken is not None and "recording the failed step in the trace then raised OSError" in fault.__notes__[0]


@pytest.mark.clause("TRACE-12")
def test_bench_throughput_trace_prints_both_sides_and_the_cost(capsys: pytest.CaptureFixture[str]) -> None:
    """TRACE-12: one run, alternating untraced and traced runs, both medians and the cost."""
    assert order(3) == [False, True, True, False, False, True]
    code = main(["bench", "throughput", "--trace", "--model", str(checkpoint("qwen3")), "--num-requests", "4",
                 "--max-input-len", "6", "--max-output-len", "3", "--threads", "1"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert [line.split(":")[0] for line in out[-4:]] == ["without trace", "with trace", "cost of tracing", "verdict"]
    assert re.fullmatch(r"verdict: (within|OVER) the 3% target: the recorder's own time is \d+\.\d\d% of an "
                        r"untraced run", out[-1]), out[-1]
    assert verdict(0.5).startswith("verdict: within the 3% target") and verdict(3.5).startswith("verdict: OVER")
    assert sum(": traced " in line for line in out) == 3 and sum(": untraced " in line for line in out) == 3


@pytest.mark.clause("TRACE-12")
def test_the_cost_of_tracing_counts_every_call_into_the_recorder(tmp_path: Path) -> None:
    """TRACE-12: the recorder's own time includes the check of each request's add record (a whole JSON encoding
    of its prompt), not only the record's making and writing."""
    from optimized.engine.sampling_params import SamplingParams
    from optimized.trace.cost import TimedObserver
    from optimized.trace.recorder import TraceObserver

    recorder = Recorder(tmp_path / "t.jsonl", SchedulerConfig(num_blocks=8, block_size=4, max_num_seqs=2,
                                                              max_num_batched_tokens=16, eos=-1), (0,))
    watch = TimedObserver(TraceObserver(recorder, 0))
    try:
        watch.check_add(list(range(50_000)), SamplingParams(max_tokens=4))
        assert watch.seconds > 0
    finally:
        recorder.close()
