"""CLI-4, CLI-6: a real ``nanoverify fuzz --minutes inf`` process interrupted by SIGINT, as Ctrl-C sends it."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _read_until(proc: subprocess.Popen[bytes], marker: bytes, limit_s: float) -> bytes:
    """Standard output up to and including the line holding ``marker`` (the process keeps running)."""
    assert proc.stdout is not None
    seen = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + limit_s
        while marker not in seen:
            left = deadline - time.monotonic()
            assert left > 0 and proc.poll() is None, f"no {marker!r} in time: {seen!r}"
            if sel.select(left):
                chunk = os.read(proc.stdout.fileno(), 4096)
                assert chunk, f"stdout closed before {marker!r}: {seen!r}"
                seen += chunk
    return seen


@pytest.mark.clause("CLI-4", "CLI-6")
def test_sigint_ends_an_endless_fuzz_with_its_summary_on_stderr_and_status_130() -> None:
    """CLI-4: the interrupted line goes to standard error (it went to standard output), no traceback, exit 130;
    CLI-6: the machines' progress so far is printed before it."""
    nanoverify = str(Path(sys.executable).parent / "nanoverify")  # the console script, as users start it
    proc = subprocess.Popen([nanoverify, "fuzz", "--minutes", "inf", "--seed", "5", "--machine", "reference"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        head = _read_until(proc, b"nanoverify fuzz: seed 5, inf minutes", 120)
        time.sleep(1.0)  # into the chunks
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out, error = (head + rest).decode(), err.decode()
    assert proc.returncode == 130, (out, error)
    lines = error.splitlines()
    assert len(lines) == 1 and lines[0].startswith("nanoverify fuzz: interrupted after "), error
    assert lines[0].endswith("chunks), nothing found"), error
    assert "interrupted" not in out and "Traceback" not in out + error
    assert "] reference: " in out  # the progress of the machine, on standard output before the line
