"""Traces that cannot be written or would not fit (TRACE-1, TRACE-4, TRACE-13), and the commands' last-resort
exit codes (CLI-8), each started as a user starts it."""

from __future__ import annotations

import gc
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from optimized.trace.recorder import Recorder, trace_file
from optimized.trace.replay import REPLAY_BYTES_PER_BLOCK, available_memory, require_memory
from optimized.trace.schema import TraceError
from reference import SchedulerConfig
from tests.engine_fixtures import checkpoint

pytestmark = pytest.mark.usefixtures("engine_env")
ROOT = Path(__file__).resolve().parent.parent
FIGURE_TRACE = ROOT / "spec" / "figures" / "preemption.trace.jsonl"
CONFIG = SchedulerConfig(num_blocks=8, block_size=4)


def _nanoverify(args: list[str], tmp_path: Path, limits: Callable[[], None] | None = None,
                timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NANOVERIFY_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-m", "optimized.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False, preexec_fn=limits)


def _run_args(trace: str) -> list[str]:
    return ["run", "--model", str(checkpoint("qwen3")), "--num-requests", "6", "--max-input-len", "12",
            "--max-output-len", "5", "--num-kvcache-blocks", "10", "--block-size", "4", "--trace", trace]


def _one_line(done: subprocess.CompletedProcess[str], command: str) -> str:
    err = done.stderr
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.startswith(f"nanoverify {command}: ") and err.count("\n") == 1, err
    return err


@pytest.mark.clause("TRACE-4")
def test_a_full_device_is_one_line_naming_the_file(tmp_path: Path) -> None:
    """TRACE-4: `--trace /dev/full` printed 'No space left on device' without the file, then an 'Exception ignored
    in <finalize>' OSError traceback at exit; now one line naming the file, exit 2."""
    done = _nanoverify(_run_args("/dev/full"), tmp_path)
    assert done.returncode == 2
    assert _one_line(done, "run") == "nanoverify run: /dev/full: No space left on device\n"


def _small_files() -> None:
    """Files of at most 600 bytes: the trace's header is written, a later step's write fails (EFBIG)."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (600, 600))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


@pytest.mark.clause("TRACE-4")
def test_a_write_failing_mid_run_leaves_nothing_to_fail_at_exit(tmp_path: Path) -> None:
    """TRACE-4: a write that fails after the header (the file size limit reached) left the file's buffer to be
    flushed again by the finalizer at exit, a second traceback; now one line naming the file, exit 2."""
    path = tmp_path / "run.jsonl"
    done = _nanoverify(_run_args(str(path)), tmp_path, _small_files)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1] == f"nanoverify run: {path}: File too large"  # after the progress bar
    assert 0 < path.stat().st_size <= 600 and path.read_text().startswith('{"version": 2')


@pytest.mark.clause("TRACE-4")
def test_the_recorder_closes_a_file_it_could_not_write() -> None:
    """TRACE-4: after a failed write the recorder's file is closed at once, so the collector's finalizer has no
    buffer left to flush (its OSError, unraisable, was the exit-time traceback)."""
    unraisable: list[Any] = []
    previous, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        with pytest.raises(OSError) as failed:
            Recorder("/dev/full", CONFIG)
        assert failed.value.filename == "/dev/full"
        del failed
        gc.collect()
    finally:
        sys.unraisablehook = previous
    assert unraisable == []


@pytest.mark.clause("TRACE-1")
def test_a_place_the_filesystem_refuses_is_refused_before_anything_loads(tmp_path: Path) -> None:
    """TRACE-1: `LLM(trace="/proc/x")` passed every check and raised FileNotFoundError only after the model loaded;
    the path is now opened once, before: a ValueError naming it. A probe leaves no file behind."""
    with pytest.raises(ValueError, match=r"trace '/proc/x' cannot be written \(No such file or directory\)"):
        trace_file("/proc/x")
    fresh = tmp_path / "fresh.jsonl"
    assert trace_file(fresh) == fresh and not fresh.exists()
    kept = tmp_path / "kept.jsonl"
    kept.write_text("a run of before\n")
    assert trace_file(kept) == kept and kept.read_text() == "a run of before\n"  # emptied only when the run starts


def _header_of(num_blocks: int, tmp_path: Path) -> Path:
    text = FIGURE_TRACE.read_text()
    assert '"num_blocks": 10,' in text
    path = tmp_path / f"blocks-{num_blocks}.jsonl"
    path.write_text(text.replace('"num_blocks": 10,', f'"num_blocks": {num_blocks},'))
    return path


@pytest.mark.clause("TRACE-13")
@pytest.mark.parametrize("args", [["replay", "--impl", "reference"], ["replay", "--impl", "optimized"],
                                  ["timeline", "--format", "perfetto"]])
def test_a_header_of_two_billion_blocks_is_refused_before_any_block_is_built(args: list[str],
                                                                              tmp_path: Path) -> None:
    """TRACE-13: `"num_blocks": 2147483648` ran for minutes towards 860 GB, then a MemoryError traceback and
    exit 1 (the code of a diverged replay); now one line naming the field, exit 2, before any block is built."""
    path = _header_of(1 << 31, tmp_path)
    done = _nanoverify([*args, str(path)], tmp_path, timeout=60)
    assert done.returncode == 2, done.stderr
    err = _one_line(done, args[0])
    assert "config.num_blocks: 2147483648 blocks need about 2048.0 GiB of memory to replay" in err
    assert done.stdout == ""


def _address_space(size: int) -> Callable[[], None]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (size, size))
    return limit


@pytest.mark.clause("TRACE-13")
def test_the_bound_is_the_memory_a_ulimit_leaves(tmp_path: Path) -> None:
    """TRACE-13: under `ulimit -v` of 2 GiB, 4 million blocks (4 GiB at the bound) are refused; the same trace
    with 10 blocks replays under that cap (a positive control: the cap itself is not what refuses)."""
    cap = 2 << 30
    big = _nanoverify(["replay", str(_header_of(4_000_000, tmp_path))], tmp_path, _address_space(cap), timeout=60)
    assert big.returncode == 2
    assert "more than the 2.0 GiB available here" in _one_line(big, "replay")
    small = _nanoverify(["replay", str(FIGURE_TRACE)], tmp_path, _address_space(cap), timeout=60)
    assert small.returncode == 0 and small.stdout.startswith("identical: "), small.stderr


@pytest.mark.clause("TRACE-13")
def test_the_bound_in_bytes() -> None:
    """TRACE-13: the refusal is `num_blocks` x 1 KiB against what is available, and what fits passes."""
    have = available_memory()
    assert have is not None and have > 0
    require_memory(1000)
    fits = have // REPLAY_BYTES_PER_BLOCK
    require_memory(fits)
    with pytest.raises(TraceError, match=r"^config\.num_blocks: "):
        require_memory(fits * 2 + 1000)


@pytest.mark.clause("CLI-8")
def test_running_out_of_memory_is_one_line_and_exit_3(tmp_path: Path) -> None:
    """CLI-8: a MemoryError ended a command with a traceback and exit 1, the code of a difference found. A 60 MB
    input under an address-space cap of the interpreter's own size plus 100 MB cannot be read whole."""
    probe = subprocess.run([sys.executable, "-c", "import optimized.cli.command, optimized.cli.replay;"
                            "print(open('/proc/self/status').read().split('VmPeak:')[1].split()[0])"],
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, check=True)
    cap = (int(probe.stdout) + 100_000) * 1024
    path = tmp_path / "blank.jsonl"
    path.write_bytes((b" " * 999 + b"\n") * 60_000)
    done = _nanoverify(["replay", str(path)], tmp_path, _address_space(cap), timeout=60)
    assert done.returncode == 3, done.stderr
    assert _one_line(done, "replay").startswith("nanoverify replay: out of memory (")


@pytest.mark.clause("CLI-8")
def test_a_failed_read_names_its_file(tmp_path: Path) -> None:
    """CLI-8: `replay /proc/self/mem` said only 'Input/output error'."""
    done = _nanoverify(["replay", "/proc/self/mem"], tmp_path, timeout=60)
    assert done.returncode == 2
    assert _one_line(done, "replay") == "nanoverify replay: /proc/self/mem: Input/output error\n"


@pytest.mark.clause("CLI-8")
def test_the_json_reader_does_not_say_at_twice(tmp_path: Path) -> None:
    """A control character inside a string: json's own message ends in 'at', and the reader said 'at at'."""
    path = tmp_path / "ctl.jsonl"
    path.write_bytes(b'{"workload": "a\x01b"}\n')
    done = _nanoverify(["replay", str(path)], tmp_path, timeout=60)
    assert done.returncode == 2
    assert _one_line(done, "replay") == "nanoverify replay: line 1: not JSON (Invalid control character at column 16)\n"
