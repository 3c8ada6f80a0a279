"""``nanoverify fuzz``: a short clean run, a missing machine, and a broken scheduler caught and reproduced."""

from __future__ import annotations

import re

import pytest

import reference.scheduler
from optimized.cli import main
from reference import Sequence

PROGRESS = re.compile(r"^\[\s*[\d.]+s\] (\w+): (\d+) examples, \d+ rule applications/s, (\d+) steps, (\d+) requests, "
                      r"\d+ preemptions, \d+ prefix-hit tokens, \d+ aborts, (\d+) violations$", re.MULTILINE)


@pytest.mark.clause("SCHED-3", "ADMIT-2")
def test_a_short_clean_run_reports_progress_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    """SCHED-3, ADMIT-2: fractional minutes; every registered machine runs at least one chunk and finds nothing."""
    code = main(["fuzz", "--minutes", "0.05", "--seed", "11"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "seed 11, 0.05 minutes" in out and "nothing found" in out
    seen = {m.group(1): m for m in PROGRESS.finditer(out)}
    assert "reference" in seen
    for name, m in seen.items():
        assert int(m.group(2)) > 0 and int(m.group(3)) > 0 and int(m.group(4)) > 0, name
        assert m.group(5) == "0"


@pytest.mark.clause("CLI-1")
def test_an_unknown_machine_is_refused_naming_the_machines(capsys: pytest.CaptureFixture[str]) -> None:
    """CLI-1: --machine names one of the registered machines, or the command refuses it in one line."""
    assert main(["fuzz", "--minutes", "0", "--machine", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "machine must be one of ['differential', 'reference'], got 'nosuch'" in err


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
