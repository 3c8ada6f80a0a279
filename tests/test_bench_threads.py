"""ENG-31: ``nanoverify bench threads``: one fresh process per configuration, the spinner gone after each run."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from optimized.benchmarks import busy_core
from optimized.cli import main


@pytest.mark.clause("ENG-31")
def test_a_child_run_reports_its_time_and_the_threads_it_ran_on(capsys: pytest.CaptureFixture[str]) -> None:
    """ENG-31: the child serves the workload and prints one JSON line; --threads is applied."""
    assert main(["bench", "threads", "--child", "--num-requests", "2", "--max-tokens", "2", "--threads", "1"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["wall"] > 0 and result["threads"] == 1


@pytest.mark.clause("ENG-31")
def test_each_configuration_runs_in_its_own_process_with_its_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """ENG-31: a configuration's wait policy reaches the child's environment ("unset" switches our default off)."""
    seen: list[dict[str, str]] = []

    def run(command: list[str], env: dict[str, str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        seen.append(env)
        return subprocess.CompletedProcess(command, 0, json.dumps({"wall": 1.0, "threads": 1}) + "\n", "")

    monkeypatch.setattr(subprocess, "run", run)
    args = argparse.Namespace(num_requests=1, max_tokens=1)
    busy_core.run_config(busy_core.Config(1, "ACTIVE"), args)
    busy_core.run_config(busy_core.Config(1, "unset"), args)
    assert seen[0]["OMP_WAIT_POLICY"] == "ACTIVE" and "NANOVERIFY_CPU_DEFAULTS" not in seen[0]
    assert "OMP_WAIT_POLICY" not in seen[1] and seen[1]["NANOVERIFY_CPU_DEFAULTS"] == "0"


@pytest.mark.clause("ENG-31")
def test_the_busy_core_spinner_runs_during_the_run_and_is_gone_after(monkeypatch: pytest.MonkeyPatch) -> None:
    """ENG-31: 'busy' means another process spins while the configuration runs, and only then."""
    spinners: list[int] = []

    def run(config: busy_core.Config, args: argparse.Namespace) -> tuple[float, int]:
        # Only this process's children: another spinning process on the machine is not ours.
        found = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", busy_core.SPIN], capture_output=True,
                               text=True).stdout.split()
        spinners.extend(int(pid) for pid in found)
        return 1.0, 1

    monkeypatch.setattr(busy_core, "run_config", run)
    busy_core.timed(busy_core.Config(1, "PASSIVE"), argparse.Namespace(), busy=True)
    assert spinners, "no spinner while the busy run ran"
    for pid in spinners:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


@pytest.mark.clause("ENG-31", "CLI-1")
def test_a_failing_run_is_one_line_naming_the_configuration_and_the_childs_reason(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """ENG-31, CLI-1: a child that cannot run (here: an unwritable cache) makes the command exit 2 with one line
    carrying the configuration and the child's own last line, not a traceback."""
    a_file = tmp_path / "a-file"
    a_file.write_text("", encoding="utf-8")
    monkeypatch.setenv("NANOVERIFY_CACHE", str(a_file))
    monkeypatch.setattr(busy_core, "POLICIES", ("PASSIVE",))
    assert main(["bench", "threads", "--num-requests", "1", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "OMP_WAIT_POLICY PASSIVE" in err and "NANOVERIFY_CACHE" in err, err
