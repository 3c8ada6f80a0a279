"""``nanoverify bench determinism`` (BI-11): run as users start it, on a tiny checkpoint and workload; with the mode on
no request differs from its run alone, in tokens or in logprob bits; with it off the logprobs do; and the comparison
it prints from sees a single bit of a single logprob."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kernels import cpu_build
from optimized.benchmarks.determinism import Difference, difference, summary
from optimized.engine.sampling_params import Logprob
from optimized.entry.llm import RequestOutput
from tests.engine_fixtures import checkpoint

pytestmark = [pytest.mark.usefixtures("engine_env"), pytest.mark.clause("BI-11")]
ROOT = Path(__file__).resolve().parent.parent
LINE = re.compile(r"^mode (on |off), crowd pass (\d) \((\d+) preemptions, (\d+) chunked prefills, (\d+) prefix-cache "
                  r"hit tokens\): (\d+)/(\d+) requests differ in tokens, (\d+)/(\d+) in logprob bits")


def test_the_bench_finds_no_difference_in_the_mode_and_some_without_it() -> None:
    """BI-11: on a tiny workload (the tiny Qwen3, 6 requests among 8 mates, chunked, preempted, a hot second pass),
    both passes with the mode on print 0 requests differing in tokens and in logprob bits; with the mode off some
    differ in logprob bits, each such line saying where they first differ (the earliest position, a histogram); the
    regimes happened; each mode's time and their ratio are printed; the exit status is 0."""
    if cpu_build.find_compiler() is None:
        pytest.skip("no C compiler: the mode is refused")
    proc = subprocess.run(
        [sys.executable, "-m", "optimized.cli", "bench", "determinism", "--model", str(checkpoint("qwen3")),
         "--block-size", "4", "--num-kvcache-blocks", "256", "--num-requests", "6", "--mates", "8",
         "--max-input-len", "40", "--max-output-len", "12", "--token-budget", "16", "--threads", "1"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = [LINE.match(line) for line in proc.stdout.splitlines()]
    rows = [m.groups() for m in found if m is not None]
    assert sorted((mode, p) for mode, p, *_ in rows) == [("off", "1"), ("off", "2"), ("on ", "1"), ("on ", "2")]
    for mode, _, _, chunked, hits, tokens, n, bits, n2 in rows:
        assert n == n2 == "6"
        assert int(chunked) > 0 and int(hits) > 0
        if mode == "on ":
            assert tokens == bits == "0"
    for on in ("on ", "off"):
        assert sum(int(preempted) for mode, _, preempted, *_ in rows if mode == on) > 0
    assert sum(int(bits) for mode, *_, bits, _ in rows if mode == "off") > 0
    for line in proc.stdout.splitlines():  # where they differ: the earliest position and a histogram
        m = LINE.match(line)
        if m is not None and int(m.group(8)) > 0:
            assert re.search(r"; first logprob difference at output position (\d+|prompt) \(histogram \{.+\}\)$",
                             line), line
    for name in ("on ", "off"):
        assert re.search(rf"^mode {name}: crowd passes \d+\.\d+ s \(\d+\.\d+ CPU s\)$", proc.stdout, re.M)
    assert re.search(r"^ratio \(on / off time\): wall \d+\.\d+, CPU \d+\.\d+$", proc.stdout, re.M)


def _output(tokens: list[int], values: list[float]) -> RequestOutput:
    return RequestOutput(0, None, [1, 2], tokens, "", "length",
                         [{t: Logprob(v, 1)} for t, v in zip(tokens, values, strict=True)],
                         [None, {2: Logprob(-1.5, 1)}])


def test_one_bit_of_one_logprob_is_a_difference() -> None:
    """BI-11: the bench's comparison is bitwise: the last bit of one generated logprob, of one prompt logprob, the
    sign of a zero or one token each count, at the right position."""
    a = _output([5, 6, 7], [-0.5, -0.25, 0.0])
    assert difference(a, a) == Difference(None, None)
    nudged = _output([5, 6, 7], [-0.5, -0.25 - 2**-54, 0.0])  # one unit in the last place
    assert difference(a, nudged) == Difference(None, 1)
    assert difference(a, _output([5, 6, 7], [-0.5, -0.25, -0.0])) == Difference(None, 2)
    assert difference(a, replace(a, prompt_logprobs=[None, {2: Logprob(-1.5000000000000002, 1)}])) == \
        Difference(None, "prompt")
    assert difference(a, _output([5, 9, 7], [-0.5, -0.25, 0.0])) == Difference(1, 1)
    assert summary([Difference(None, None)] * 2) == "0/2 requests differ in tokens, 0/2 in logprob bits"
    assert summary([Difference(1, 1), Difference(None, "prompt"), Difference(None, 3)]) == (
        "1/3 requests differ in tokens, 3/3 in logprob bits; first logprob difference at output position 1 "
        "(histogram {1: 1, 3: 1, prompt: 1})")


def test_lengths_past_the_model_are_refused_naming_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """BI-11: prompts and outputs that cannot fit the model's max_model_len are a ValueError naming both flags,
    before any request runs (nothing printed)."""
    import argparse

    from optimized.benchmarks import determinism

    parser = argparse.ArgumentParser()
    determinism.add_arguments(parser)
    args = parser.parse_args(["--model", str(checkpoint("qwen3")), "--max-input-len", "250", "--max-output-len", "7",
                              "--num-kvcache-blocks", "16"])
    with pytest.raises(ValueError, match=r"^--max-input-len 250 \+ --max-output-len 7 exceeds the model's "
                                         r"max_model_len=256$"):
        determinism.main(args)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(("flags", "says"), [
    (["--dtype", "bfloat16"], "batch_invariant cannot hold: dtype bfloat16"),
    (["--attention-backend", "torch"], "batch_invariant cannot hold: attention backend 'torch'"),
    (["--num-kvcache-blocks", "2"], "--max-input-len 8 + --max-output-len 4 cannot fit the KV cache of a request run "
                                    "alone (2 blocks of 4 tokens: --num-kvcache-blocks, --block-size)"),
])
def test_settings_that_cannot_run_are_one_line_before_anything_runs(flags: list[str], says: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """BI-11, CLI-1: settings where the mode cannot hold, or where a request cannot fit the KV cache alone, are one
    line on standard error and exit 2 with nothing on standard output, before any request runs (they were refused
    by the first run that met them, after the workload line, a dtype the mode refuses after a mode-off run)."""
    from optimized.cli import main

    code = main(["bench", "determinism", "--model", str(checkpoint("qwen3")), "--block-size", "4", "--num-requests",
                 "2", "--mates", "2", "--max-input-len", "8", "--max-output-len", "4", "--threads", "1", *flags])
    out, err = capsys.readouterr()
    assert (code, out, err.count("\n")) == (2, "", 1), (out, err)
    assert err.startswith("nanoverify bench determinism: ") and says in err, err
