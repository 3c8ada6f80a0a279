"""``nanoverify replay``: traces out in input order; malformed workloads refused by line and field (CONF-6)."""

from __future__ import annotations

import copy
import io
import json
import re
import subprocess
import sys
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optimized.cli import main
from optimized.core.errors import WorkloadError
from optimized.verify.conformance import Workload, implementation, read_workloads, replay


def shipped_lines() -> list[str]:
    text = resources.files("optimized.verify").joinpath("data/conformance.jsonl").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


LINES = shipped_lines()
SAMPLES = [json.loads(line) for line in LINES]
reference_impl, optimized_impl = implementation("reference"), implementation("optimized")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], list[str]]:
    code = main(["replay", *argv])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


@pytest.mark.clause("CONF-6", "CONF-5")
def test_replay_file_prints_each_trace_in_input_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """CONF-6, CONF-5: one {"trace": ...} line per workload, equal to the shipped traces."""
    path = tmp_path / "samples.jsonl"
    path.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    code, out, err = run(capsys, "--impl", "reference", str(path))
    assert code == 0 and err == []
    assert [json.loads(line) for line in out] == [{"trace": s["trace"]} for s in SAMPLES]


@pytest.mark.clause("CONF-6")
def test_replay_stdin_skips_lines_without_a_workload(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """CONF-6: '-' reads standard input; lines without a 'workload' key and blank lines are skipped."""
    chosen = [LINES[3], LINES[64], LINES[10]]
    text = "\n".join([json.dumps({"comment": "no workload here"}), chosen[0], "", chosen[1], "[1, 2]", chosen[2]])
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO((text + "\n").encode()), encoding="utf-8"))
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


@pytest.mark.clause("CONF-6", "CONF-1")
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


@pytest.mark.clause("CONF-6")
def test_not_json_and_a_missing_file_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """CONF-6: unreadable input is one clear line too."""
    path = tmp_path / "bad.jsonl"
    path.write_text(LINES[0] + "\n{not json\n", encoding="utf-8")
    code, out, err = run(capsys, "--impl", "reference", str(path))
    assert code == 2 and out == [] and len(err) == 1 and "line 2" in err[0]
    code, out, err = run(capsys, "--impl", "reference", str(tmp_path / "missing.jsonl"))
    assert code == 2 and out == [] and len(err) == 1 and "missing.jsonl" in err[0]


POLICY_LINE = r"{name}: 15/15 traces identical to the {policy} reference's, \d+ steps, 0 invariant violations"


@pytest.mark.clause("CONF-7", "POLICY-14")
def test_conformance_command_summarises_both_implementations(capsys: pytest.CaptureFixture[str]) -> None:
    """CONF-7, POLICY-14: both implementations reproduce all 80 lesson samples and every policy's 15 with no
    violation, and the command says so, a line per implementation and policy."""
    assert main(["conformance"]) == 0
    out = capsys.readouterr().out
    for name in ("reference", "optimized"):
        assert re.search(rf"{name}: 80/80 traces identical to the lesson's, \d+ steps, 0 invariant violations", out)
        for policy in ("mixed", "priority", "lpm"):
            assert re.search(POLICY_LINE.format(name=name, policy=policy), out), out


@pytest.mark.clause("CONF-7", "POLICY-14")
def test_conformance_command_replays_every_policy(capsys: pytest.CaptureFixture[str]) -> None:
    """CONF-7, POLICY-14: the reference's run names the lesson and each policy, in that order."""
    assert main(["conformance", "--impl", "reference"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.match(r"reference: 80/80 traces identical to the lesson's", lines[0])
    for line, policy in zip(lines[1:], ("mixed", "priority", "lpm"), strict=True):
        assert re.match(POLICY_LINE.format(name="reference", policy=policy), line), line


@pytest.mark.clause("CONF-7")
def test_conformance_command_fails_on_a_differing_trace(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """CONF-7: one sample whose recorded trace differs makes the summary say 79/80 and the exit status 1."""
    from optimized.cli import conformance

    samples = conformance.shipped_samples()
    samples[0]["trace"][0]["batch"][0][1] += 1
    monkeypatch.setattr(conformance, "shipped_samples", lambda: samples)
    assert main(["conformance", "--impl", "reference"]) == 1
    assert "reference: 79/80 traces identical" in capsys.readouterr().out


@pytest.mark.clause("POLICY-14")
def test_conformance_command_fails_on_a_differing_policy_trace(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """POLICY-14: one priority sample whose trace differs: 14/15 for priority, the others whole, exit status 1."""
    from optimized.cli import conformance

    samples = conformance.shipped_policy_samples()
    first = next(s for s in samples if conformance.policy_of(s) == "priority")
    first["trace"][0]["batch"][0][1] += 1
    monkeypatch.setattr(conformance, "shipped_policy_samples", lambda: samples)
    assert main(["conformance", "--impl", "reference"]) == 1
    out = capsys.readouterr().out
    assert "reference: 14/15 traces identical to the priority reference's" in out
    assert "reference: 15/15 traces identical to the lpm reference's" in out


# --- the reader treats its input as hostile bytes (CLI-7) -------------------------------------------------------

def sample_with(change: Callable[[dict[str, Any]], None]) -> str:
    sample = copy.deepcopy(SAMPLES[1])
    change(sample["workload"])
    return json.dumps(sample)


def set_at(*path: str | int, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(w: dict[str, Any]) -> None:
        node: Any = w
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return change


@pytest.mark.clause("CONF-6", "CLI-7")
@pytest.mark.parametrize(("path", "value", "field"), [
    (("requests", 0, "prompt", 0), 1 << 63, "requests[0].prompt[0]"),
    (("requests", 0, "output", 0), 1 << 63, "requests[0].output[0]"),
    (("config", "eos"), 1 << 70, "config.eos"),
    (("config", "eos"), -(1 << 63) - 1, "config.eos"),
    (("config", "max_num_seqs"), 1 << 64, "config.max_num_seqs"),
    (("config", "max_num_batched_tokens"), 1 << 64, "config.max_num_batched_tokens"),
    (("requests", 0, "id"), 1 << 63, "requests[0].id"),
    (("requests", 0, "arrive"), 1 << 63, "requests[0].arrive"),
])
def test_an_integer_beyond_int64_is_refused_before_anything_is_replayed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], path: tuple[str | int, ...], value: int,
        field: str) -> None:
    """CONF-6, CLI-7: a token id >= 2**63 (or any integer beyond int64) used to pass validation and crash the replay
    mid-way, after the earlier lines' traces were printed; now it is exit 2, one line, nothing replayed."""
    path_ = tmp_path / "big.jsonl"
    path_.write_text("\n".join([LINES[0], sample_with(set_at(*path, value=value)), LINES[2]]) + "\n",
                     encoding="utf-8")
    for impl in ("reference", "optimized"):
        code, out, err = run(capsys, "--impl", impl, str(path_))
        assert (code, out) == (2, [])
        assert len(err) == 1 and "line 2" in err[0] and field in err[0] and "int64" in err[0], err


@pytest.mark.clause("CLI-7")
def test_the_largest_int64_token_id_replays(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """CLI-7: the bound is exactly int64: 2**63 - 1 is a token id like any other."""
    line = sample_with(set_at("requests", 0, "prompt", 0, value=(1 << 63) - 1))
    path = tmp_path / "edge.jsonl"
    path.write_text(line + "\n", encoding="utf-8")
    for impl in ("reference", "optimized"):
        code, out, err = run(capsys, "--impl", impl, str(path))
        assert code == 0 and err == [] and len(out) == 1


@pytest.mark.clause("CLI-7")
@pytest.mark.parametrize(("data", "message"), [
    (b'{"workload": "caf\xe9"}\n', "line 1: not UTF-8 (byte 0xe9 at offset 17)"),
    (b"\xff\xfe{}\n", "line 1: not UTF-8"),
    (b"[" * 100_000 + b"\n", "line 1: nested deeper than 16 levels"),
    (b'{"a": ' * 17 + b"1" + b"}" * 17 + b"\n", "line 1: nested deeper than 16 levels"),
    (b'{"x": "' + b"\\\"" * 200_000 + b"[" * 40 + b"\n", "line 1: not JSON"),
    (b"\n\n" + b"9" * 5000 + b"\n", "line 3: not JSON"),
    (b"\x00\n", "line 1: not JSON"),
    (b"1" * (1 << 20) + b"1\n", "line 1: longer than 1048576 bytes"),
])
def test_hostile_bytes_are_one_line_naming_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      data: bytes, message: str) -> None:
    """CLI-7: invalid UTF-8, deep nesting, a brace inside a string, an integer of 5000 digits, a line over the limit:
    exit 2, one stderr line naming the line, no traceback (deep nesting used to end in RecursionError)."""
    path = tmp_path / "hostile.jsonl"
    path.write_bytes(data)
    code, out, err = run(capsys, str(path))
    assert (code, out) == (2, [])
    assert len(err) == 1 and err[0].startswith(f"nanoverify replay: {message}"), err


@pytest.mark.clause("CLI-7")
def test_nesting_up_to_the_limit_and_brackets_in_strings_are_fine(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """CLI-7: 16 levels are allowed, and brackets inside strings do not count."""
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps({"note": "[" * 100, "deep": [[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]}) + "\n" + LINES[0] + "\n",
                    encoding="utf-8")
    code, out, err = run(capsys, str(path))
    assert code == 0 and err == [] and len(out) == 1


@pytest.mark.clause("CLI-7")
def test_an_input_over_the_size_limit_is_refused_without_reading_on(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """CLI-7: the whole input is bounded too (64 MiB; made smaller here to keep the test small)."""
    from optimized.verify import conformance

    monkeypatch.setattr(conformance, "MAX_INPUT_BYTES", 3 * max(len(line) for line in LINES[:4]))
    path = tmp_path / "long.jsonl"
    path.write_text("\n".join(LINES[:4]) + "\n", encoding="utf-8")
    code, out, err = run(capsys, str(path))
    assert (code, out) == (2, []) and err == [f"nanoverify replay: input longer than {conformance.MAX_INPUT_BYTES} "
                                              "bytes"]
    assert run(capsys, "/dev/zero")[0] == 2  # endless and without a newline: refused at the first line's limit


@pytest.mark.clause("CLI-7")
def test_empty_input_is_nothing_to_replay_and_closed_stdin_is_one_line(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """CLI-7: empty input (or only blank lines) holds nothing to replay: exit 2, one line, nothing on standard
    output; a closed standard input (`nanoverify replay - <&-`) is exit 2 and one line."""
    nothing = ["nanoverify replay: the input is empty (or blank lines only): nothing to replay"]
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b""), encoding="utf-8"))
    assert run(capsys, "-") == (2, [], nothing)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\n  \n\r\n"), encoding="utf-8"))
    assert run(capsys, "-") == (2, [], nothing)
    closed = subprocess.run(["sh", "-c", 'exec "$0" -m optimized.cli replay - <&-', sys.executable],
                            capture_output=True, text=True, timeout=60, check=False)
    assert (closed.returncode, closed.stdout) == (2, "")
    assert closed.stderr == "nanoverify replay: standard input is closed\n"
    (tmp_path / "dir").mkdir()
    assert run(capsys, str(tmp_path / "dir"))[0:2] == (2, [])


# The integers a mutation puts in: edges of every bound the reader checks, and beyond.
EDGE_INTS = st.sampled_from([1 << 63, (1 << 63) - 1, -(1 << 63) - 1, -(1 << 63), 1 << 64, 10 ** 30, (1 << 16) + 1,
                             1 << 16, (1 << 20) + 1, 0, 1, 2, -1, 3, 7])
ANY_JSON = st.recursive(
    st.none() | st.booleans() | EDGE_INTS | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)


def paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside ``node``."""
    found = [prefix]
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, child in children:
        found += paths(child, (*prefix, key))
    return found


# The smallest shipped workloads (traces dropped): mutations of them replay fast.
SMALL_WORKLOADS = sorted((s["workload"] for s in SAMPLES), key=lambda w: len(json.dumps(w)))[:12]


@st.composite
def mutated_line(draw: st.DrawFn) -> bytes:
    """A shipped workload with some values replaced, some keys dropped, then maybe a few bytes changed."""
    line: dict[str, Any] = {"workload": copy.deepcopy(draw(st.sampled_from(SMALL_WORKLOADS)))}
    for _ in range(draw(st.integers(1, 2))):
        inside = paths(line)[1:]
        if not inside:
            break
        path = draw(st.sampled_from(inside))
        parent: Any = line
        for key in path[:-1]:
            parent = parent[key]
        how = draw(st.sampled_from(["edge", "edge", "edge", "any", "drop"]))
        if how == "drop" and isinstance(parent, dict):
            del parent[path[-1]]
        elif how != "drop":
            parent[path[-1]] = draw(EDGE_INTS if how == "edge" else ANY_JSON)
    data = bytearray(json.dumps(line).encode())
    if draw(st.integers(0, 3)) == 0:
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


def read_or_refuse(data: bytes) -> list[Workload]:
    """What the reader makes of ``data``: workloads, or [] after a WorkloadError (anything else fails the test)."""
    try:
        return read_workloads(io.BytesIO(data))
    except WorkloadError as e:
        assert "\n" not in str(e) and str(e).startswith(("line ", "input ")), str(e)
        return []


@pytest.mark.clause("CLI-7", "CONF-6")
@given(st.binary(max_size=300))
def test_fuzz_reader_bytes_give_workloads_or_workload_error(data: bytes) -> None:
    """CLI-7, CONF-6: any bytes at all: the reader returns workloads or raises WorkloadError, nothing else."""
    read_or_refuse(data)


# More examples than the ci profile's 25: at 100 this finds the old int64 crash in 9 runs of 10, in under a second.
@pytest.mark.clause("CLI-7", "CONF-6")
@settings(max_examples=100)
@given(st.lists(mutated_line(), min_size=1, max_size=2))
def test_fuzz_reader_mutated_workloads_replay_or_are_refused(lines: list[bytes]) -> None:
    """CLI-7, CONF-6: a mutated workload is refused by WorkloadError, or else it replays on both implementations
    without an exception: validation covers everything the replay relies on."""
    for workload in read_or_refuse(b"\n".join(lines)):
        for impl in (reference_impl, optimized_impl):
            replay(workload, impl)
