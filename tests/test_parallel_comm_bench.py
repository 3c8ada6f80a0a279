"""``python -m optimized.parallel.comm_bench`` as users start it (spec/parallel.md TP-10, TP-11): gloo's all-reduce
and the rank-order one timed in alternation over ``--ranks`` real processes; bad flags refused by name."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from optimized.parallel import comm_bench
from optimized.parallel.comm_bench import TOKENS

BENCH = [sys.executable, "-m", "optimized.parallel.comm_bench"]
ROW = re.compile(r"^\s+(\d+) tokens .* gloo\s+([\d.]+) us .* in rank order\s+([\d.]+) us\s+ratio\s+([\d.]+)$")


@pytest.mark.clause("TP-10", "TP-11")
def test_the_bench_times_both_all_reduces_over_three_ranks() -> None:
    """TP-10, TP-11: over 3 processes (an odd count, where gloo's order depends on the size) it prints, for each
    size, gloo's median and the rank-order one's and their ratio, and exits 0 with every process gone."""
    done = subprocess.run([*BENCH, "--ranks", "3", "--repeats", "3", "--hidden", "8"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "between 3 processes" in lines[0] and "[tokens, 8]" in lines[0] and "median of 3" in lines[0], lines[0]
    rows = [ROW.match(line) for line in lines[1:]]
    assert all(rows) and [int(r[1]) for r in rows if r] == list(TOKENS), done.stdout
    for r in rows:
        assert r is not None and float(r[2]) > 0 and float(r[3]) > 0
        assert float(r[4]) == pytest.approx(float(r[3]) / float(r[2]), abs=0.01, rel=0.02)


@pytest.mark.clause("TP-10")
@pytest.mark.parametrize("flags", [["--ranks", "1"], ["--hidden", "0"], ["--repeats", "0"], ["--ranks", "two"]])
def test_bad_flags_are_refused_by_name_before_any_process_starts(
    flags: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP-10: fewer than 2 ranks, no hidden width or no repeats, or a word for a number, is exit 2 with the flag
    named on stderr, before any store or process is made."""

    def no_store() -> None:
        raise AssertionError("a store was made for bad flags")

    monkeypatch.setattr(comm_bench, "private_store", no_store)
    with pytest.raises(SystemExit) as exit_:
        comm_bench.main(flags)
    out = capsys.readouterr()
    assert exit_.value.code == 2 and flags[0] in out.err and out.out == "", out
