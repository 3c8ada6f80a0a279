"""Every subcommand meets garbage with one line on standard error and exit 2 (spec/cli.md).

Most cases run ``main([...])`` in process: each piece of garbage is refused before
any model loads. Subprocesses only where the operating system is the point: a
reader closing the pipe early, argv bytes that are not UTF-8.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis.stateful import RuleBasedStateMachine

from optimized.cli import command as cli
from optimized.cli import fuzz, main
from optimized.engine import arg_types
from optimized.verify.machines import Stats

ROOT = Path(__file__).resolve().parent.parent
MISSING = "/nonexistent/nanoverify"
A_FILE = str(Path(__file__))  # a file where a folder belongs
A_FOLDER = str(Path(__file__).parent)  # a folder where a file belongs



@pytest.fixture(autouse=True)
def _scratch_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing here should reach a cache; if a regression does, it writes into a scratch folder, not HOME."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NANOVERIFY_CACHE", str(tmp_path / "cache"))


GARBAGE: dict[str, list[list[str]]] = {
    "run": [["--num-requests", "-1"], ["--num-requests", "nan"], ["--max-output-len", str(10 ** 30)],
            ["--block-size", "abc"], ["--num-kvcache-blocks", "0"], ["--max-num-seqs", "1e3"], ["--seed", "1.5"],
            ["--model", MISSING], ["--model", A_FILE], ["--no-such-flag"], ["stray"]],
    "replay": [[MISSING], [A_FOLDER], ["--impl", "nope", A_FILE], [], [A_FILE, A_FILE]],
    "conformance": [["--impl", "nope"], ["stray"]],
    "fuzz": [["--minutes", "nan"], ["--minutes", "-1"], ["--minutes", "-inf"], ["--minutes", "abc"], [],
             ["--minutes", "1", "--seed", "x"], ["--minutes", "0", "--machine", "nosuch"],
             ["--reproduce", "AAAA"], ["--machine", "reference", "--reproduce", "!!not base64!!"],
             ["--machine", "reference", "--reproduce", "caf\udce9"]],
    "bench scheduler": [["--repeat", "0"], ["--repeat", "-3"], ["--repeat", str(10 ** 9)], ["--seed", "nan"]],
    "bench throughput": [["--num-requests", "-1"], ["--threads", "-3"], ["--threads", "0"], ["--model", MISSING],
                         ["--model", A_FILE], ["--max-input-len", "inf"], ["--hf-batch-size", "0"],
                         ["--max-output-len", str(1 << 64)], ["--dtype", "int8"]],
    "generate": [[], ["--model", MISSING, "hi"], ["--model", A_FILE, "hi"], ["--seed", "abc", "hi"],
                 ["--max-tokens", "x", "hi"], ["caf\udce9"], ["--temperature", "nan", "hi"],
                 ["--temperature", "-1", "hi"], ["--top-p", "2", "hi"], ["--top-k", "-2", "hi"],
                 ["--max-tokens", "-5", "hi"]],
    "gpu-check": [["--deadline-s", "nan"], ["--deadline-s", "-1"], ["--deadline-s", "inf"], ["--work", A_FILE],
                  ["--device", "tpu"], ["--device", "cpu"], ["--device", "cpu", "--tiny", "--stages", "bogus"]],
    "bench threads": [["--num-requests", "0"], ["--max-tokens", "-1"], ["--max-tokens", "nan"], ["--repeat", "0"],
                      ["stray"]],
    "serve": [["--port", "70000"], ["--port", "-1"], ["--shutdown-timeout", "nan"], ["--model", MISSING],
              ["--tensor-parallel-size", "0"], ["--stream-interval", "0"], ["--trace-wall-times"], ["stray"]],
    "bench serve": [["--rate", "-1"], ["--requests", "0"], ["--burstiness", "nan"], ["--trace-file", MISSING]],
    "timeline": [[MISSING], [A_FOLDER], ["--format", "gif", A_FILE], ["--index", "-1", A_FILE], []],
    "bench": [[], ["nope"]],
    "": [[], ["no-such-command"]],
}
CASES = [(command, args) for command, table in GARBAGE.items() for args in table]


@pytest.mark.clause("CLI-1", "CLI-2", "CLI-5")
@pytest.mark.parametrize(("command", "args"), CASES, ids=[f"{c or 'top'}:{' '.join(a)}" for c, a in CASES])
def test_garbage_is_one_line_and_exit_2(command: str, args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """CLI-1, CLI-2, CLI-5: every subcommand, any garbage (negative, nan, inf, huge, not a number, a missing file, a
    folder as a file, a file as a folder, an unknown flag, non-UTF-8 text): exit 2, exactly one line on standard error
    naming the command, no traceback, nothing on standard output."""
    code = main([*command.split(), *args])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert out == "" and err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith(f"nanoverify {command}".rstrip() + ":") and "Traceback" not in err, err


@pytest.mark.clause("CLI-2")
def test_parse_time_messages_name_the_flag_and_the_rule(capsys: pytest.CaptureFixture[str]) -> None:
    """CLI-2: bench throughput's --threads -3 (a RuntimeError deep in torch before), --threads 0 (silently 2 threads
    before) and --num-requests -1 (a ZeroDivisionError before) are refused at parse time, by flag and range."""
    for flag, value in (("--threads", "-3"), ("--threads", "0"), ("--num-requests", "-1")):
        assert main(["bench", "throughput", flag, value]) == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: must be an integer in [1, " in err and f"got '{value}'" in err


@pytest.mark.clause("CLI-1")
def test_value_and_os_errors_of_any_command_are_one_line(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """CLI-1: whatever a command raises as ValueError (the loader's bad-checkpoint messages) or OSError (an unwritable
    cache, DefaultModelUnavailable) is `nanoverify <command>: <message>`, one line, exit 2; an OSError reads
    'file: reason'."""
    raised: list[BaseException] = [
        ValueError("config.json: bad\n  field 'x'"),
        PermissionError(13, "Permission denied", "/proc/cache"),
        type("DefaultModelUnavailable", (OSError,), {})("cannot write the default model; set NANOVERIFY_CACHE"),
    ]
    expected = ["nanoverify conformance: config.json: bad field 'x'",
                "nanoverify conformance: /proc/cache: Permission denied",
                "nanoverify conformance: cannot write the default model; set NANOVERIFY_CACHE"]
    for error, line in zip(raised, expected, strict=True):
        def fail(args: argparse.Namespace, error: BaseException = error) -> int:
            raise error
        monkeypatch.setattr(cli.COMMANDS["conformance"], "main", fail)
        assert main(["conformance"]) == 2
        assert capsys.readouterr().err == line + "\n"


@pytest.mark.clause("CLI-1")
def test_a_damaged_checkpoint_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """CLI-1: a real loader error (a checkpoint folder whose config.json is not JSON) through `generate`."""
    (tmp_path / "config.json").write_text("{", encoding="utf-8")
    assert main(["generate", "--model", str(tmp_path), "--device", "cpu", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nanoverify generate: ") and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.clause("CLI-4")
def test_ctrl_c_is_one_line_and_exit_130(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """CLI-4: KeyboardInterrupt in any command ends it with one line and status 130, no traceback."""
    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt
    monkeypatch.setattr(cli.COMMANDS["conformance"], "main", interrupted)
    assert main(["conformance"]) == 130
    assert capsys.readouterr().err == "nanoverify conformance: interrupted\n"


def _python(*args: str) -> list[str]:
    return [sys.executable, "-m", "optimized.cli", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.mark.clause("CLI-3")
@pytest.mark.parametrize("args", [
    ["replay", str(ROOT / "optimized" / "verify" / "data" / "conformance.jsonl")],
    ["fuzz", "--minutes", "0", "--seed", "1", "--machine", "reference"],
], ids=["replay", "fuzz"])
def test_a_reader_that_closes_the_pipe_early_ends_the_command_quietly(args: list[str]) -> None:
    """CLI-3: `nanoverify replay ... | head` and `nanoverify fuzz ... | head` gave a BrokenPipeError traceback; now
    the command stops at the first failed write, prints nothing on standard error and exits 141."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes its first line
    try:
        done = subprocess.run(_python(*args), stdout=write, stderr=subprocess.PIPE, text=True, env=_env(),
                              timeout=120, check=False)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, "")


@pytest.mark.clause("CLI-3")
def test_a_reader_that_reads_a_little_then_closes(tmp_path: Path) -> None:
    """CLI-3: the same when some output was read first (`| head -c 100`), mid-way through the traces."""
    lines = (ROOT / "optimized" / "verify" / "data" / "conformance.jsonl").read_text(encoding="utf-8")
    path = tmp_path / "many.jsonl"
    path.write_text(lines * 4, encoding="utf-8")  # ~1 MB of traces: far more than a pipe holds
    proc = subprocess.Popen(_python("replay", str(path)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    assert proc.stdout is not None and proc.stderr is not None
    head = proc.stdout.read(100)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == b""
    assert head.startswith(b'{"trace": [')


@pytest.mark.clause("CLI-5")
def test_a_prompt_argument_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    """CLI-5: `nanoverify generate $'caf\\xe9'` (a Latin-1 byte in argv) gave a TypeError traceback; now one line naming
    the byte, exit 2, before any model loads."""
    done = subprocess.run([os.fsencode(sys.executable), b"-m", b"optimized.cli", b"generate", b"caf\xe9"],
                          capture_output=True, env=_env(), timeout=120, check=False)
    assert done.returncode == 2 and done.stdout == b""
    assert done.stderr.decode() == ("nanoverify generate: argument PROMPT: must be UTF-8 text, got 'caf\\udce9' (byte "
                                    "0xe9 at position 3) (see nanoverify generate --help)\n")


@pytest.mark.clause("CLI-6")
def test_fuzz_minutes_nan_and_negative_are_refused_inf_is_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    """CLI-6: --minutes nan used to run one round and exit 0; nan and negatives are refused, inf is a number."""
    for value in ("nan", "-0.5", "-inf"):
        assert main(["fuzz", f"--minutes={value}"]) == 2
        assert "argument --minutes: must be a number >= 0 (or inf)" in capsys.readouterr().err
    assert arg_types.minutes("inf") == math.inf and arg_types.minutes("0") == 0.0


@pytest.mark.clause("CLI-6")
def test_fuzz_inf_runs_until_ctrl_c_then_reports_and_exits_130(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """CLI-6: --minutes inf runs chunk after chunk until interrupted; Ctrl-C prints the progress and exits 130."""
    calls: list[int] = []

    def chunk(machine: type[RuleBasedStateMachine], stats: Stats, seed: int, shrink: bool) -> BaseException | None:
        calls.append(seed)
        if len(calls) == 4:
            raise KeyboardInterrupt
        stats.examples += 5  # a clean chunk, without the time a real one takes
        return None

    monkeypatch.setattr(fuzz, "run_chunk", chunk)
    assert main(["fuzz", "--minutes", "inf", "--seed", "5", "--machine", "reference"]) == 130
    out = capsys.readouterr().out
    assert "seed 5, inf minutes" in out and "interrupted after" in out and "(3 chunks)" in out
    assert "reference: 15 examples" in out.split("interrupted after")[0]  # the progress line, printed before
    assert calls == [5, 6, 7, 8]


@pytest.mark.clause("CLI-6")
def test_fuzz_garbage_blob_is_bad_input_not_a_finding(capsys: pytest.CaptureFixture[str]) -> None:
    """CLI-6: a --reproduce blob that does not decode was reported as a FAILURE of the machine (exit 1)."""
    assert main(["fuzz", "--machine", "reference", "--reproduce", "garbage"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "nanoverify fuzz: --reproduce: not a @reproduce_failure blob: 'garbage'\n"


@pytest.mark.clause("CLI-6", "CLI-7")
def test_help_documents_inf_and_the_limits(capsys: pytest.CaptureFixture[str]) -> None:
    """CLI-6, CLI-7: --help says what inf does and what the replay reader accepts."""
    for argv, words in ((["fuzz", "--help"], "inf runs until Ctrl-C"), (["replay", "--help"], "at most 64 MiB")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0
        assert words in " ".join(capsys.readouterr().out.split())

