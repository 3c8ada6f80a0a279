"""ENG-31: the CPU defaults: OpenMP threads wait passively unless the user says otherwise, and torch's threads are
capped at the CPUs this process may use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from optimized.engine import cpu_defaults

PROBE = "import os, sys\n{first}\nprint(os.environ.get('OMP_WAIT_POLICY', 'unset'))"


def policy_after(first: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", cpu_defaults.SWITCH)}
    done = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], env={**clean, **env},
                          capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.mark.clause("ENG-31")
def test_importing_optimized_first_makes_openmp_wait_passively() -> None:
    """ENG-31: set before torch loads libgomp, which reads it once."""
    assert policy_after("import optimized, torch") == "PASSIVE"


@pytest.mark.clause("ENG-31")
def test_the_users_policy_the_switch_and_an_earlier_torch_are_respected() -> None:
    """ENG-31: a value the user set is kept; NANOVERIFY_CPU_DEFAULTS=0 sets nothing; after torch it is too late."""
    assert policy_after("import optimized", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
    assert policy_after("import optimized", NANOVERIFY_CPU_DEFAULTS="0") == "unset"
    assert policy_after("import torch, optimized") == "unset"


@pytest.mark.clause("ENG-31")
@pytest.mark.parametrize(("text", "cpus"), [("200000 100000", 2), ("150000 100000", 2), ("50000 100000", 1),
                                            ("max 100000", None), ("garbage", None)])
def test_a_cgroup_quota_is_read_as_cpus_rounded_up(tmp_path: Path, text: str, cpus: int | None) -> None:
    """ENG-31: cpu.max's 'quota period'; 'max' or anything unreadable is no limit."""
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text(text, encoding="ascii")
    assert cpu_defaults.cgroup_cpus(cpu_max) == cpus
    assert cpu_defaults.cgroup_cpus(tmp_path / "absent") is None


@pytest.mark.clause("ENG-31")
def test_threads_are_lowered_to_the_usable_cpus_and_never_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """ENG-31: an LLM caps torch's threads at the CPUs this process may use, and leaves a lower setting alone."""
    before = torch.get_num_threads()
    monkeypatch.setattr(cpu_defaults, "usable_cpus", lambda: 1)
    try:
        torch.set_num_threads(2)
        cpu_defaults.cap_threads()
        assert torch.get_num_threads() == 1
        monkeypatch.setattr(cpu_defaults, "usable_cpus", lambda: 2)
        cpu_defaults.cap_threads()
        assert torch.get_num_threads() == 1
        monkeypatch.setenv(cpu_defaults.SWITCH, "0")
        monkeypatch.setattr(cpu_defaults, "usable_cpus", lambda: 1)
        torch.set_num_threads(2)
        cpu_defaults.cap_threads()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.clause("ENG-31")
def test_an_llm_caps_the_threads_when_it_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """ENG-31: making an LLM applies the cap (here: as if this process could use one CPU)."""
    from optimized import LLM

    before = torch.get_num_threads()
    monkeypatch.setattr(cpu_defaults, "usable_cpus", lambda: 1)
    try:
        torch.set_num_threads(2)
        LLM()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
