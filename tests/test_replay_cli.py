"""``nanoverify replay``: traces out in input order; malformed workloads refused by line and field (CONF-6)."""

from __future__ import annotations

import copy
import io
import json
import re
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from optimized.cli import main


def shipped_lines() -> list[str]:
    text = resources.files("optimized").joinpath("data/conformance.jsonl").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


LINES = shipped_lines()
SAMPLES = [json.loads(line) for line in LINES]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], list[str]]:
    code = main(["replay", *argv])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


def test_replay_file_prints_each_trace_in_input_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """CONF-6, CONF-5: one {"trace": ...} line per workload, equal to the shipped traces."""
    path = tmp_path / "samples.jsonl"
    path.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    code, out, err = run(capsys, "--impl", "reference", str(path))
    assert code == 0 and err == []
    assert [json.loads(line) for line in out] == [{"trace": s["trace"]} for s in SAMPLES]


def test_replay_stdin_skips_lines_without_a_workload(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """CONF-6: '-' reads standard input; lines without a 'workload' key and blank lines are skipped."""
    chosen = [LINES[3], LINES[64], LINES[10]]
    text = "\n".join([json.dumps({"comment": "no workload here"}), chosen[0], "", chosen[1], "[1, 2]", chosen[2]])
    monkeypatch.setattr("sys.stdin", io.StringIO(text + "\n"))
    code, out, err = run(capsys, "--impl", "reference", "-")
    assert code == 0 and err == []
    assert [json.loads(line)["trace"] for line in out] == [json.loads(c)["trace"] for c in chosen]


def corrupted(change: Callable[[dict[str, Any]], None]) -> str:
    sample = copy.deepcopy(SAMPLES[0])
    change(sample["workload"])
    return json.dumps(sample)


def drop_eos(w: dict[str, Any]) -> None:
    del w["config"]["eos"]


def block_size_one(w: dict[str, Any]) -> None:
    w["config"]["block_size"] = 1


def empty_prompt(w: dict[str, Any]) -> None:
    w["requests"][2]["prompt"] = []


def short_output(w: dict[str, Any]) -> None:
    w["requests"][1]["output"] = w["requests"][1]["output"][:-1]


def negative_arrive(w: dict[str, Any]) -> None:
    w["requests"][0]["arrive"] = -1


@pytest.mark.parametrize(("change", "field"), [
    (drop_eos, "config.eos"),
    (block_size_one, "config.block_size"),
    (empty_prompt, "requests[2].prompt"),
    (short_output, "requests[1].output"),
    (negative_arrive, "requests[0].arrive"),
])
def test_a_malformed_workload_is_refused_by_line_and_field(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           change: Callable[[dict[str, Any]], None],
                                                           field: str) -> None:
    """CONF-6, CONF-1: exit 2, one stderr line naming line 3 and the field, no traceback, nothing replayed."""
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([LINES[0], LINES[1], corrupted(change), LINES[2]]) + "\n", encoding="utf-8")
    code, out, err = run(capsys, "--impl", "reference", str(path))
    assert code == 2 and out == []
    assert len(err) == 1 and "line 3" in err[0] and field in err[0]
    assert "Traceback" not in err[0]


def test_not_json_and_a_missing_file_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """CONF-6: unreadable input is one clear line too."""
    path = tmp_path / "bad.jsonl"
    path.write_text(LINES[0] + "\n{not json\n", encoding="utf-8")
    code, out, err = run(capsys, "--impl", "reference", str(path))
    assert code == 2 and out == [] and len(err) == 1 and "line 2" in err[0]
    code, out, err = run(capsys, "--impl", "reference", str(tmp_path / "missing.jsonl"))
    assert code == 2 and out == [] and len(err) == 1 and "missing.jsonl" in err[0]


def test_conformance_command_summarises_both_implementations(capsys: pytest.CaptureFixture[str]) -> None:
    """CONF-7: both implementations reproduce all 80 samples with no violation, and the command says so."""
    assert main(["conformance"]) == 0
    out = capsys.readouterr().out
    for name in ("reference", "optimized"):
        assert re.search(rf"{name}: 80/80 traces identical to the lesson's, \d+ steps, 0 invariant violations", out)


def test_conformance_command_fails_on_a_differing_trace(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """CONF-7: one sample whose recorded trace differs makes the summary say 79/80 and the exit status 1."""
    from optimized.commands import conformance

    samples = conformance.shipped_samples()
    samples[0]["trace"][0]["batch"][0][1] += 1
    monkeypatch.setattr(conformance, "shipped_samples", lambda: samples)
    assert main(["conformance", "--impl", "reference"]) == 1
    assert "reference: 79/80 traces identical" in capsys.readouterr().out
