"""``nanoverify fuzz``: a short clean run, a missing machine, each policy's machine alone and its state comparison's
negative controls, and a broken scheduler caught and reproduced."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest

import reference.scheduler
from invariants import SchedulerState
from optimized.cli import main
from optimized.cli.fuzz import CHUNK_EXAMPLES
from optimized.core.lpm_scheduler import LpmScheduler
from optimized.core.mixed_scheduler import MixedScheduler
from optimized.core.priority_scheduler import PriorityScheduler
from optimized.verify.machines import MACHINES
from reference import Sequence

PROGRESS = re.compile(r"^\[\s*[\d.]+s\] ([\w-]+): (\d+) examples, \d+ rule applications/s, (\d+) steps, "
                      r"(\d+) requests, \d+ preemptions, \d+ prefix-hit tokens, \d+ aborts, (\d+) violations$",
                      re.MULTILINE)


@pytest.mark.clause("SCHED-3", "ADMIT-2", "POLICY-13")
def test_a_short_clean_run_reports_progress_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    """SCHED-3, ADMIT-2, POLICY-13: fractional minutes; every registered machine (a differential one per policy
    among them) runs at least one chunk, in the registry's order, and finds nothing."""
    code = main(["fuzz", "--minutes", "0.05", "--seed", "11"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"seed 11, 0.05 minutes, machines {', '.join(MACHINES)}" in out and "nothing found" in out
    seen = {m.group(1): m for m in PROGRESS.finditer(out)}
    assert list(seen) == list(MACHINES) == ["reference", "differential", "differential-mixed",
                                            "differential-priority", "differential-lpm"]
    for name, m in seen.items():
        assert int(m.group(2)) > 0 and int(m.group(3)) > 0 and int(m.group(4)) > 0, name
        assert m.group(5) == "0"


@pytest.mark.clause("CLI-1")
def test_an_unknown_machine_is_refused_naming_the_machines(capsys: pytest.CaptureFixture[str]) -> None:
    """CLI-1: --machine names one of the registered machines, or the command refuses it in one line."""
    assert main(["fuzz", "--minutes", "0", "--machine", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert ("machine must be one of ['differential', 'differential-lpm', 'differential-mixed', "
            "'differential-priority', 'reference'], got 'nosuch'") in err


@pytest.mark.clause("POLICY-13")
@pytest.mark.parametrize("name", ["differential-mixed", "differential-priority", "differential-lpm"])
def test_machine_runs_one_policy_machine_alone(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """POLICY-13: ``--machine differential-<policy>`` runs that machine and no other, and it finds nothing."""
    code = main(["fuzz", "--minutes", "0", "--seed", "5", "--machine", name])
    out = capsys.readouterr().out
    assert code == 0, out
    assert [m.group(1) for m in PROGRESS.finditer(out)] == [name]
    m = next(PROGRESS.finditer(out))
    assert int(m.group(2)) >= CHUNK_EXAMPLES and int(m.group(3)) > 0 and m.group(5) == "0"  # one chunk at least


def shifted_priorities(self: PriorityScheduler) -> SchedulerState:
    state = original_snapshot[PriorityScheduler](self)
    return dataclasses.replace(state, priorities={k: p + 1 for k, p in state.priorities.items()})


def passed_once_more(self: LpmScheduler) -> SchedulerState:
    state = original_snapshot[LpmScheduler](self)
    return dataclasses.replace(state, passes={k: n + 1 for k, n in state.passes.items()})


def more_patient(self: LpmScheduler) -> SchedulerState:
    return dataclasses.replace(original_snapshot[LpmScheduler](self), patience=self.patience + 1)


def called_lesson(self: MixedScheduler) -> SchedulerState:
    return dataclasses.replace(original_snapshot[MixedScheduler](self), policy="lesson")


original_snapshot: dict[type[Any], Callable[[Any], SchedulerState]] = {
    cls: cls.snapshot for cls in (PriorityScheduler, LpmScheduler, MixedScheduler)}


@pytest.mark.clause("POLICY-13")
@pytest.mark.parametrize(("name", "cls", "corrupt"), [
    ("differential-priority", PriorityScheduler, shifted_priorities),
    ("differential-lpm", LpmScheduler, passed_once_more),
    ("differential-lpm", LpmScheduler, more_patient),
    ("differential-mixed", MixedScheduler, called_lesson),
])
def test_a_policy_state_misreported_is_a_disagreement(name: str, cls: type[Any], corrupt: Any,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """POLICY-13, the negative control of the machines' state comparison: an optimized policy whose snapshot
    misreports its own state (every priority one higher, which keeps their order; every waiting request passed
    over once more; the patience one more; the policy's name) while deciding as the reference is reported."""
    monkeypatch.setattr(cls, "snapshot", corrupt)
    code = main(["fuzz", "--minutes", "0", "--seed", "5", "--machine", name, "--no-shrink"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert f"FAILURE in machine {name}: Disagreement: OPT-1 after add: states differ" in out


@pytest.mark.clause("POST-1")
def test_a_broken_scheduler_is_reported_with_how_to_reproduce_it(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """POST-1: postprocess that leaves a chunk's tokens scheduled is caught, and the blob reproduces it."""
    original = reference.scheduler.Scheduler.postprocess

    def forgetful(self: reference.scheduler.Scheduler, seqs: list[Sequence], token_ids: list[int],
                  is_prefill: bool) -> None:
        scheduled = [s.num_scheduled_tokens for s in seqs]
        original(self, seqs, token_ids, is_prefill)
        for seq, n in zip(seqs, scheduled, strict=True):
            if seq.status.name != "FINISHED" and n > 1:
                seq.num_scheduled_tokens = 1

    monkeypatch.setattr(reference.scheduler.Scheduler, "postprocess", forgetful)
    code = main(["fuzz", "--minutes", "0.05", "--seed", "3", "--machine", "reference", "--no-shrink"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAILURE in machine reference: StepFailed: POST-1" in out
    program = out.split("The failing program (", 1)[1].split("To reproduce:", 1)[0]
    assert "a_server_starts(" in program  # the machine's first rule, as the program applied it
    command = re.search(r"nanoverify fuzz --machine reference --reproduce (\S+)", out)
    assert command is not None and "@reproduce_failure(" in out
    assert "rerun the whole run: nanoverify fuzz --machine reference --minutes 0.05 --seed 3 --no-shrink" in out

    blob = command.group(1)
    assert main(["fuzz", "--machine", "reference", "--reproduce", blob]) == 1
    assert "StepFailed: POST-1" in capsys.readouterr().out
    monkeypatch.setattr(reference.scheduler.Scheduler, "postprocess", original)
    assert main(["fuzz", "--machine", "reference", "--reproduce", blob]) == 0
    assert "no longer fails" in capsys.readouterr().out
