"""Every subcommand meets garbage with one line on standard error and exit 2 (spec/cli.md).

Most cases run ``main([...])`` in process: each piece of garbage is refused before
any model loads. Subprocesses only where the operating system is the point: a
reader closing the pipe early, argv bytes that are not UTF-8.
"""

from __future__ import annotations

import argparse
import math
import os
import re
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
                 ["--max-tokens", "-5", "hi"], ["--device", "cpu:7", "hi"], ["--device", "tpu", "hi"],
                 ["--model", "", "hi"], ["--trace", "", "hi"], ["--trace", A_FOLDER, "hi"]],
    "gpu-check": [["--deadline-s", "nan"], ["--deadline-s", "-1"], ["--deadline-s", "inf"], ["--work", A_FILE],
                  ["--device", "tpu"], ["--device", "cpu"], ["--device", "cpu", "--tiny", "--stages", "bogus"]],
    "bench threads": [["--num-requests", "0"], ["--max-tokens", "-1"], ["--max-tokens", "nan"], ["--repeat", "0"],
                      ["stray"]],
    "serve": [["--port", "70000"], ["--port", "-1"], ["--shutdown-timeout", "nan"], ["--model", MISSING],
              ["--tensor-parallel-size", "0"], ["--stream-interval", "0"], ["--trace-wall-times"], ["stray"],
              ["--device", "tpu"], ["--device", "cuda:x"], ["--model", ""], ["--trace", ""]],
    "bench determinism": [["--num-requests", "0"], ["--logprobs", "21"], ["--token-budget", "nan"]],
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


@pytest.mark.clause("CLI-2")
@pytest.mark.parametrize(("command", "flag", "value"), [
    ("generate hi", "--device", "cpu:7"), ("serve", "--device", "tpu"), ("run", "--device", "cuda:"),
    ("generate hi", "--model", ""), ("serve", "--model", ""), ("generate hi", "--trace", ""),
    ("serve", "--trace", ""), ("run", "--trace", A_FOLDER),
])
def test_device_model_and_trace_are_refused_by_the_parser(command: str, flag: str, value: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """CLI-2: --device, --model '' and --trace '' passed the parser (a device and a file were plain strings, '' is
    the current folder to Path) and were refused later by field name, serve's after it imported torch and fastapi,
    `generate --device cpu:7` not at all (torch ignores a CPU index); now the parser refuses them by flag."""
    words = command.split()
    assert main([words[0], flag, value, *words[1:]]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nanoverify {words[0]}: argument {flag}: must be ") and err.count("\n") == 1, err
    if flag == "--device":
        assert "'cpu', 'cuda' or 'cuda:N'" in err and "another CPU index is refused" in err


@pytest.mark.clause("CLI-2")
def test_the_device_rule() -> None:
    """CLI-2: the devices the parser takes are EngineArgs' (one rule): cpu, cuda, cuda:N, and cpu:0 (torch's cpu)."""
    for name in ("cpu", "cpu:0", "cuda", "cuda:0", "cuda:12"):
        assert arg_types.device_name(name) == name
    for name in ("cpu:1", "cuda:", "cuda:-1", "cuda:\u00b2", "CPU", "mps", " cpu", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            arg_types.device_name(name)


@pytest.mark.clause("CLI-1", "KNOB-3")
def test_a_kv_budget_beyond_the_machines_memory_is_refused_before_the_cache_is_made() -> None:
    """KNOB-3: --cpu-kvcache-gib 1e30 (LLM(cpu_kvcache_gib=1e9)) tried to allocate it: a torch RuntimeError and a
    traceback. One check now serves the budget and num_kvcache_blocks: a ValueError naming the setting and the
    machine's memory, before the cache exists (only the sizes are computed here; nothing large is allocated)."""
    import torch

    from optimized.engine.assembly import kv_cache_blocks

    cpu = torch.device("cpu")
    for gib in (1e9, 1e30):
        with pytest.raises(ValueError, match=rf"^{re.escape(f'cpu_kvcache_gib={gib}')} needs \d+ bytes of KV "
                                             r"cache, more than this machine's memory \(\d+ bytes\)$"):
            kv_cache_blocks(cpu, 4096, None, 0.9, gib)
    with pytest.raises(ValueError, match=r"^num_kvcache_blocks=1000000000000 needs "):
        kv_cache_blocks(cpu, 4096, 10 ** 12, 0.9, 0.5)
    assert kv_cache_blocks(cpu, 4096, None, 0.9, 0.5) == (1 << 29) // 4096


@pytest.mark.clause("CLI-1", "KNOB-3")
@pytest.mark.usefixtures("engine_env")
def test_a_huge_kv_budget_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """CLI-1, KNOB-3: `bench throughput --cpu-kvcache-gib 1e30` (and generate's, serve's) gave a torch traceback
    and exit 1; now one line naming the setting, exit 2."""
    from tests.engine_fixtures import checkpoint

    folder = str(checkpoint("qwen3"))
    capsys.readouterr()  # the checkpoint's making, when this test makes it
    assert main(["bench", "throughput", "--model", folder, "--device", "cpu", "--num-requests",
                 "2", "--max-input-len", "4", "--max-output-len", "2", "--cpu-kvcache-gib", "1e30"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nanoverify bench throughput: cpu_kvcache_gib=1e+30 needs ") and err.count("\n") == 1
    assert "more than this machine's memory" in err
    from optimized import LLM

    with pytest.raises(ValueError, match=r"^cpu_kvcache_gib=1000000000\.0 needs "):  # a RuntimeError before
        LLM(folder, device="cpu", cpu_kvcache_gib=1e9)


@pytest.mark.clause("CLI-1")
@pytest.mark.usefixtures("engine_env")
def test_run_names_max_model_len_without_blaming_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    """CLI-1: with the user's own --max-model-len 8, run said "exceeds the model's max_model_len=8"; it names the
    setting alone now."""
    from tests.engine_fixtures import checkpoint

    folder = str(checkpoint("qwen3"))
    capsys.readouterr()  # the checkpoint's making, when this test makes it
    assert main(["run", "--model", folder, "--device", "cpu", "--max-model-len", "8",
                 "--max-input-len", "6", "--max-output-len", "5"]) == 2
    assert capsys.readouterr().err == ("nanoverify run: --max-input-len 6 + --max-output-len 5 exceeds "
                                       "max_model_len=8\n")


@pytest.mark.clause("CLI-2")
def test_help_shows_run_counts_as_n_and_what_seed_seeds(capsys: pytest.CaptureFixture[str]) -> None:
    """CLI-2: run's own counts show N in the usage like the engine's, and --seed's help says it seeds run's and
    bench throughput's workloads too; generate's --seed says it is the requests'."""
    helps = {}
    for argv in (["run", "--help"], ["generate", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        helps[argv[0]] = " ".join(capsys.readouterr().out.split())
    for flag in ("--num-requests", "--max-input-len", "--max-output-len", "--seed"):
        assert f"{flag} N " in helps["run"], flag
    assert "run and bench throughput: of their workload too" in helps["run"]
    assert "(SamplingParams.seed)" in helps["generate"] and "workload" not in helps["generate"]


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
    out, err = capsys.readouterr()
    assert "seed 5, inf minutes" in out and "reference: 15 examples" in out  # the progress line
    assert "interrupted after" in err and "(3 chunks)" in err  # CLI-4: on standard error
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

