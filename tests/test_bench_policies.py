"""``nanoverify bench policies`` (POLICY-18): the command on a tiny trace and model, its latency and goodput math on
known inputs (each beside a wrong definition the expected numbers reject), the trace's scaling, its refusals, and
the shipped excerpt's attribution."""

from __future__ import annotations

import csv
import itertools
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from optimized.benchmarks import policies as bench
from optimized.benchmarks.serve import Job, percentiles, trace_rows
from optimized.cli import command
from optimized.core.config import POLICIES
from optimized.engine.engine import EngineStats
from optimized.engine.sampling_params import SamplingParams
from optimized.entry.llm import RequestOutput
from tests.engine_fixtures import checkpoint

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "optimized" / "benchmarks" / "data"
SOURCE = Path("/work/shared/traces/azure-llm-2023-conv.csv")  # the processed copy the excerpt was cut from


def write_trace(path: Path, rows: list[tuple[float, int, int]]) -> Path:
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["arrived_at", "num_prefill_tokens", "num_decode_tokens"])
        out.writerows(rows)
    return path


# --- the command, end to end ---------------------------------------------------------------------------------------
@pytest.mark.clause("POLICY-18")
@pytest.mark.usefixtures("engine_env")
def test_the_command_runs_two_policies_and_prints_every_column(tmp_path: Path) -> None:
    """POLICY-18: on a tiny model and an 8-row trace, two policies in two rounds (the second backwards) each print
    one line with a number in every column (TTFT, TBT, E2E percentiles, goodput, preemptions, hit rate, output
    tok/s), the medians of the rounds, then the second policy's ratios to the lesson's; --plot writes a PNG; exit
    status 0."""
    rows = [(0.0, 120, 16), (0.01, 40, 10), (0.05, 300, 8), (0.1, 64, 12), (0.12, 64, 12), (0.3, 200, 6),
            (0.31, 8, 20), (0.4, 100, 4)]
    trace = write_trace(tmp_path / "tiny.csv", rows)
    figure = tmp_path / "policies.png"
    proc = subprocess.run(
        [sys.executable, "-m", "optimized.cli", "bench", "policies", "--model", str(checkpoint("qwen3")),
         "--block-size", "4", "--num-kvcache-blocks", "128", "--max-num-batched-tokens", "32",
         "--trace-file", str(trace), "--policies", "lesson,mixed", "--plot", str(figure), "--rounds", "2"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if line.startswith("policy "))
    for title, _, _ in bench.COLUMNS:
        assert title in header
    tokens = sum(bench.scale_lengths(p, d, 4.0, 2.0, 256)[1] for _, p, d in rows)
    for policy in ("lesson", "mixed"):
        row = next(line for line in lines if line.startswith(f"{policy} "))
        cells = row.split()[1:]
        assert len(cells) == len(bench.COLUMNS) and all(re.fullmatch(r"\d+(\.\d+)?%?|n/a", c) for c in cells), row
        for k in (1, 2):
            assert f"  {policy} (round {k}/2): 8 requests, {tokens} output tokens in " in proc.stdout
    assert lines.index("each column the median of the 2 rounds:") == lines.index(header) - 1
    rounds = [line.split(" (round")[0].strip() for line in lines if " (round " in line]
    assert rounds == ["lesson", "mixed", "mixed", "lesson"]  # the second round backwards
    ratios = lines[lines.index("ratio to lesson (this run):") + 1]
    assert re.fullmatch(rf"mixed(\s+(\d+\.\d\dx|n/a)){{{len(bench.COLUMNS)}}}", ratios.rstrip()), ratios
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- the math ------------------------------------------------------------------------------------------------------
@pytest.mark.clause("POLICY-18")
def test_percentiles_interpolate_between_order_statistics() -> None:
    """POLICY-18: p50, p90, p99 of 1..4 interpolate linearly (numpy's default); the nearest-rank definition, the
    control, gives other values, so the expected numbers tell the two apart."""
    stats = percentiles([4.0, 1.0, 3.0, 2.0])
    assert stats == pytest.approx({"mean": 2.5, "p50": 2.5, "p90": 3.7, "p99": 3.97})

    def nearest_rank(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    assert [nearest_rank([1.0, 2.0, 3.0, 4.0], q) for q in (0.5, 0.9, 0.99)] != pytest.approx([2.5, 3.7, 3.97])


@pytest.mark.clause("POLICY-18")
def test_a_timing_measures_from_arrival_and_every_gap() -> None:
    """POLICY-18: TTFT and E2E count from the arrival, not from the first token's step; the gaps are between
    consecutive tokens, none for a one-token request."""
    t = bench.Timing(1.0, [1.5, 1.6, 2.6])
    assert (t.ttft, t.e2e) == pytest.approx((0.5, 1.6))
    assert t.gaps == pytest.approx([0.1, 1.0])
    assert bench.Timing(0.0, [0.2]).gaps == []


@pytest.mark.clause("POLICY-18")
def test_goodput_needs_both_slos_and_every_gap() -> None:
    """POLICY-18: goodput is the share of requests with TTFT <= slo_ttft and every gap <= slo_tbt. The set holds
    one request of each kind: both met, TTFT missed, one gap in 20 missed (its median and its mean gap meet the
    SLO: the control, a median definition, counts it), and a one-token request (no gap: met). Only the every-gap
    definition gives 2/4."""
    fine = bench.Timing(0.0, [0.1 * k for k in range(1, 6)])
    late = bench.Timing(0.0, [2.0, 2.1, 2.2])
    one_stall = bench.Timing(0.0, [0.1 + 0.05 * k for k in range(20)] + [0.1 + 0.05 * 19 + 0.5])
    single = bench.Timing(0.0, [0.3])
    timings = [fine, late, one_stall, single]
    assert bench.goodput(timings, slo_ttft=1.0, slo_tbt=0.2) == 0.5  # fine and single only

    def by_gap_median(ts: list[bench.Timing]) -> float:  # a wrong definition: the request's median gap
        return sum(t.ttft <= 1.0 and percentiles(t.gaps)["p50"] <= 0.2 if t.gaps else t.ttft <= 1.0
                   for t in ts) / len(ts)

    assert by_gap_median(timings) == 0.75  # the control: it lets the stalled request through
    assert bench.goodput([one_stall], 1.0, 0.51) == 1.0
    assert bench.goodput([one_stall], 1.0, 0.49) == 0.0


@pytest.mark.clause("POLICY-18")
def test_the_summary_pools_every_gap_and_counts_the_cache() -> None:
    """POLICY-18: the TBT percentiles are over every gap of every request pooled (not per-request percentiles
    averaged: the control differs), hit rate is hit / looked-up tokens, output tok/s counts to the last token."""
    a = bench.Timing(0.0, [0.1, 0.2, 0.3, 0.4])  # gaps 0.1 x 3
    b = bench.Timing(0.0, [0.5, 1.5])  # one gap of 1.0
    s = bench.summarize(bench.Replay("lesson", [a, b], bench.Counters(2, 30, 120)), 1.0, 0.5)
    assert s.tbt["p50"] == pytest.approx(0.1) and s.tbt["mean"] == pytest.approx(1.3 / 4)
    assert s.tbt["max"] == pytest.approx(1.0)
    averaged = (percentiles(a.gaps)["p50"] + percentiles(b.gaps)["p50"]) / 2
    assert averaged != pytest.approx(s.tbt["p50"])
    assert (s.preemptions, s.hit_rate, s.goodput) == (2, 0.25, 0.5)
    assert s.output_tps == pytest.approx(6 / 1.5)
    assert math.isnan(bench.summarize(bench.Replay("x", [a], bench.Counters(0, 0, 0)), 1.0, 1.0).hit_rate)


@pytest.mark.clause("POLICY-18")
def test_the_table_prints_the_ratios_to_the_lesson_of_the_same_run() -> None:
    """POLICY-18: one line per policy, then each other policy's ratio to the lesson's, column by column."""
    fast = bench.Timing(0.0, [0.1, 0.15, 0.2])
    slow = bench.Timing(0.0, [0.2, 0.3, 0.4])
    lines = bench.table([bench.summarize(bench.Replay("lesson", [slow], bench.Counters(1, 0, 10)), 1.0, 1.0),
                         bench.summarize(bench.Replay("mixed", [fast], bench.Counters(0, 5, 10)), 1.0, 1.0)])
    assert lines[0].split()[:3] == ["policy", "TTFT", "p50"]
    assert lines[3] == "ratio to lesson (this run):"
    cells = lines[4].split()
    assert cells[0] == "mixed" and len(cells) == len(bench.COLUMNS) + 1
    column = {key: k + 1 for k, (_, key, _) in enumerate(bench.COLUMNS)}
    assert cells[column["ttft.p50"]] == "0.50x" and cells[column["tbt.p99"]] == "0.50x"
    assert cells[column["output_tps"]] == "2.00x" and cells[column["preemptions"]] == "0.00x"
    assert cells[column["hit_rate"]] == "n/a"  # the lesson's is 0: no ratio
    assert len(bench.table([bench.summarize(bench.Replay("mixed", [fast], bench.Counters(0, 0, 0)), 1.0, 1.0)])) == 2


@pytest.mark.clause("POLICY-18")
def test_rounds_report_each_columns_median() -> None:
    """POLICY-18: over rounds each column is the median of its rounds' values (the middle one of three, not the
    mean: the control); one round is its own summary; a hit rate not measured in some round is not measured."""
    def one(ttft: float, gap: float, hits: int, queried: int) -> bench.Summary:
        return bench.summarize(bench.Replay("mixed", [bench.Timing(0.0, [ttft, ttft + gap])],
                                            bench.Counters(hits, hits, queried)), 1.0, 1.0)

    rounds = [one(0.1, 0.01, 1, 10), one(0.5, 0.05, 2, 10), one(0.2, 0.9, 9, 10)]
    m = bench.median_summary(rounds)
    assert (m.ttft["p50"], m.tbt["p99"], m.preemptions, m.hit_rate) == pytest.approx((0.2, 0.05, 2, 0.2))
    assert m.ttft["p50"] != pytest.approx(sum(r.ttft["p50"] for r in rounds) / 3)
    assert m.goodput == 1.0 and m.policy == "mixed"
    assert bench.median_summary(rounds[:1]) is rounds[0]
    assert math.isnan(bench.median_summary([rounds[0], one(0.1, 0.01, 0, 0)]).hit_rate)


@pytest.mark.clause("POLICY-18", "POLICY-19")
def test_the_targets_are_printed_with_both_sides() -> None:
    """POLICY-18, POLICY-19: on a trace, mixed's p99 TBT and output tok/s beside the lesson's with the ratios, and
    the lesson's p99 / p50 TBT; on the shared-prefix workload lpm's hit rate and mean TTFT beside the lesson's;
    nothing without the lesson."""
    lesson = bench.summarize(bench.Replay("lesson", [bench.Timing(0.0, [0.2, 0.21, 0.22, 0.42])],
                                          bench.Counters(0, 25, 100)), 1.0, 1.0)
    other = bench.summarize(bench.Replay("mixed", [bench.Timing(0.0, [0.1, 0.15, 0.2, 0.25])],
                                         bench.Counters(0, 50, 100)), 1.0, 1.0)
    (line,) = bench.targets([lesson, other], shared_prefix=False)
    p99 = percentiles([0.01, 0.01, 0.2])["p99"] * 1000
    assert line.startswith(f"target (POLICY-19): p99 TBT mixed 50.0 ms vs lesson {p99:.1f} ms (")
    assert "output tok/s mixed 16.0 vs lesson 9.5 (1.68x)" in line
    assert line.endswith(f"the lesson's p99 / p50 TBT {p99 / 10:.2f}x")
    lpm = bench.Summary(**{**vars(other), "policy": "lpm"})
    (line,) = bench.targets([lesson, lpm], shared_prefix=True)
    assert line == ("target (POLICY-19): prefix-cache hit rate lpm 50.0% vs lesson 25.0% (2.00x); mean TTFT lpm "
                    "100.0 ms vs lesson 200.0 ms (0.50x)")
    assert bench.targets([other, lpm], shared_prefix=True) == []


@pytest.mark.clause("POLICY-18")
def test_a_policy_that_decided_as_the_lesson_is_called_noise() -> None:
    """POLICY-18: priority (every request at priority 0) and lpm without a single prefix hit decide as the lesson:
    the report says so; lpm with hits and mixed get no note."""
    t = [bench.Timing(0.0, [0.1])]
    notes = bench.same_as_lesson([bench.Replay(p, t, bench.Counters(0, 0, 10)) for p in POLICIES])
    assert [n.split()[2] for n in notes] == ["priority", "lpm"]
    assert bench.same_as_lesson([bench.Replay("lpm", t, bench.Counters(0, 3, 10))]) == []


class FakeLLM:
    """The step API's shape without a model: each step gives every live request one token; it records when each
    request was added."""

    def __init__(self) -> None:
        self.stats = EngineStats(preemptions=5, prefix_cache_hit_tokens=7, prefix_cache_query_tokens=9)
        self.added: list[float] = []
        self.live: dict[int, tuple[int, int]] = {}  # request id -> (tokens so far, tokens asked)

    def add_request(self, prompt: list[int], params: SamplingParams) -> int:
        self.added.append(time.perf_counter())
        self.live[len(self.added) - 1] = (0, params.max_tokens)
        return len(self.added) - 1

    def step(self) -> list[RequestOutput]:
        time.sleep(0.002)
        self.stats.preemptions += 1
        self.stats.prefix_cache_query_tokens += 10
        done = []
        for rid, (got, asked) in list(self.live.items()):
            self.live[rid] = (got + 1, asked)
            if got + 1 == asked:
                del self.live[rid]
                done.append(RequestOutput(rid, None, [], [0] * asked, "", "length"))
        return done

    def completion_tokens(self, rid: int, start: int = 0) -> list[int] | None:
        return None if rid not in self.live else [0] * (self.live[rid][0] - start)


@pytest.mark.clause("POLICY-18")
def test_a_request_is_added_once_its_arrival_has_passed() -> None:
    """POLICY-18: the replay adds no request before its arrival time, idles while nothing is queued, times every
    token from the arrival (each at the end of its step), and counts only its own engine counters."""
    jobs = [Job(0.0, [1], 3), Job(0.05, [1], 2), Job(0.05, [1], 1), Job(0.2, [1], 4)]
    llm = FakeLLM()
    start = time.perf_counter()
    r = bench.replay(llm, "lesson", jobs)  # type: ignore[arg-type]
    assert all(at - start >= j.arrival - 1e-3 for at, j in zip(llm.added, jobs, strict=True))
    assert llm.added[3] - llm.added[0] >= 0.2 - 1e-3  # it waited for the last arrival, with nothing queued
    assert [len(t.token_times) for t in r.timings] == [3, 2, 1, 4] and r.output_tokens == 10
    assert all(t.ttft >= 0.002 and all(g >= 0.002 for g in t.gaps) for t in r.timings)
    steps = llm.stats.preemptions - 5  # one a step, from the 5 the engine had before the replay
    assert r.counters == bench.Counters(steps, 0, 10 * steps) and steps >= 4


# --- the workload --------------------------------------------------------------------------------------------------
@pytest.mark.clause("POLICY-18")
def test_lengths_are_divided_and_clamped_to_the_model() -> None:
    """POLICY-18: output = round(decode / output_scale) in [1, max_model_len - 1], prompt = round(prefill /
    prompt_scale) in [1, max_model_len - output]."""
    assert bench.scale_lengths(1000, 100, 4.0, 2.0, 4096) == (250, 50)
    assert bench.scale_lengths(100_000, 10, 4.0, 2.0, 4096) == (4091, 5)
    assert bench.scale_lengths(0, 0, 4.0, 2.0, 4096) == (1, 1)
    assert bench.scale_lengths(10, 100_000, 4.0, 2.0, 256) == (1, 255)
    assert bench.scale_lengths(6, 3, 4.0, 2.0, 256) == (2, 2)  # round half to even: 1.5 -> 2


@pytest.mark.clause("POLICY-18")
def test_a_rate_rescales_the_arrivals_and_keeps_the_bursts() -> None:
    """POLICY-18: with a rate R the arrivals, from the first, are multiplied by one factor so that (n - 1) / span
    = R; each gap keeps its share of the span. With 'recorded' they are the trace's, from its first; the default is
    5/s. One instant has no rate: refused, naming --rate."""
    times = [10.0, 11.0, 13.0, 16.0]
    assert bench.rescale_arrivals(times, None) == [0.0, 1.0, 3.0, 6.0]
    scaled = bench.rescale_arrivals(times, 2.0)
    assert scaled == pytest.approx([0.0, 0.25, 0.75, 1.5])
    assert (len(scaled) - 1) / scaled[-1] == pytest.approx(2.0)
    shares = [(b - a) / 6.0 for a, b in itertools.pairwise(times)]
    assert [(b - a) / scaled[-1] for a, b in itertools.pairwise(scaled)] == pytest.approx(shares)
    assert (bench.trace_rate(None), bench.trace_rate("recorded"), bench.trace_rate(7.0)) == (5.0, None, 7.0)
    for flat in ([5.0], [5.0, 5.0]):
        with pytest.raises(ValueError, match=r"^--rate: "):
            bench.rescale_arrivals(flat, 1.0)


@pytest.mark.clause("POLICY-18")
def test_the_workload_is_drawn_from_its_seed() -> None:
    """POLICY-18: the same rows and seed give the same requests, another seed other prompt tokens of the same
    lengths and times."""
    rows = [(0.0, 40, 8), (0.5, 80, 2), (2.0, 12, 30)]
    one = bench.trace_workload(rows, 257, 256, 4.0, 2.0, None, seed=1)
    assert one == bench.trace_workload(rows, 257, 256, 4.0, 2.0, None, seed=1)
    other = bench.trace_workload(rows, 257, 256, 4.0, 2.0, None, seed=2)
    assert [j.prompt for j in one] != [j.prompt for j in other]
    assert [(j.arrival, len(j.prompt), j.output_len) for j in one] == \
        [(j.arrival, len(j.prompt), j.output_len) for j in other] == [(0.0, 10, 4), (0.5, 20, 1), (2.0, 3, 15)]


@pytest.mark.clause("POLICY-18", "POLICY-19")
def test_the_shared_prefix_workload_interleaves_its_system_prompts() -> None:
    """POLICY-18, POLICY-19: every request opens with one of the system prompts, all of them used and
    interleaved (no run of one prompt's requests takes them all), then 16..64 tokens of its own; its KV cache holds
    two system prompts and six requests' own tokens; a system prompt that cannot fit is refused, naming
    --prefix-len."""
    jobs = bench.shared_prefix_workload(40, 4, 32, 257, 256, 10.0, seed=0)
    heads = [tuple(j.prompt[:32]) for j in jobs]
    assert len(set(heads)) == 4
    switches = sum(a != b for a, b in itertools.pairwise(heads))
    assert switches > 10
    assert all(16 <= len(j.prompt) - 32 <= 64 and 8 <= j.output_len <= 32 for j in jobs)
    assert all(a.arrival <= b.arrival for a, b in itertools.pairwise(jobs))
    assert bench.shared_prefix_blocks(512, 16) == 2 * 32 + 6 * 6
    with pytest.raises(ValueError, match=r"^--prefix-len: "):
        bench.shared_prefix_workload(4, 2, 200, 257, 256, 10.0, seed=0)


# --- refusals ------------------------------------------------------------------------------------------------------
@pytest.mark.clause("POLICY-18")
@pytest.mark.parametrize(("flags", "named"), [
    (["--rate", "0"], "--rate"), (["--rate", "-2"], "--rate"), (["--rate", "fast"], "--rate"),
    (["--rate", "inf"], "--rate"), (["--policies", "lesson,fifo"], "--policies"),
    (["--policies", "lesson,lesson"], "--policies"), (["--slo-tbt", "0"], "--slo-tbt"),
    (["--shared-prefix", "--trace-file", "x.csv"], "--trace-file"),
    (["--shared-prefix", "--rate", "recorded"], "--rate"),
    (["--trace-file", "MISSING.csv"], "--trace-file"), (["--trace-file", "BAD_COLUMN"], "--trace-file"),
    (["--trace-file", "BAD_NUMBER"], "--trace-file"), (["--trace-file", "BAD_ORDER"], "--trace-file"),
    (["--trace-file", "A_FOLDER"], "--trace-file"), (["--trace-file", "NOT_UTF8"], "--trace-file"),
])
def test_bad_input_is_one_line_naming_the_flag(flags: list[str], named: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """POLICY-18: a bad rate, an unknown or repeated policy, a bad SLO, a trace file that is missing, lacks a
    column, holds a word for a number, goes back in time, is a folder or not UTF-8: exit status 2 and one line naming
    the command and the flag, nothing on standard output, before any model is loaded."""
    files = {"MISSING.csv": tmp_path / "missing.csv",
             "BAD_COLUMN": write_trace(tmp_path / "c.csv", [(0.0, 1, 1)]),
             "BAD_NUMBER": tmp_path / "n.csv", "BAD_ORDER": write_trace(tmp_path / "o.csv", [(1.0, 1, 1), (0.5, 2, 2)])}
    files["A_FOLDER"] = tmp_path
    files["NOT_UTF8"] = tmp_path / "latin1.csv"
    files["NOT_UTF8"].write_bytes(b"arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,4,4\n\xe9\xff,1,1\n")
    files["BAD_COLUMN"].write_text("arrived_at,num_prefill_tokens\n0.0,4\n")
    files["BAD_NUMBER"].write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,many,4\n")
    argv = ["bench", "policies", *(str(files.get(f, f)) for f in flags)]
    assert command.main(argv) == command.BAD_INPUT
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("nanoverify bench policies: ") and named in err, err


@pytest.mark.clause("POLICY-18")
def test_plot_without_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """POLICY-18: --plot without matplotlib is a ValueError naming --plot and the plot extra (the command asks
    before any model loads)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(ValueError, match=r"^--plot needs matplotlib: install the plot extra"):
        bench.pyplot()


# --- the shipped excerpt -------------------------------------------------------------------------------------------
@pytest.mark.clause("POLICY-18")
def test_every_shipped_trace_is_attributed_and_parses() -> None:
    """POLICY-18: the data README names every shipped CSV, the source, its licence and the Vidur copy's; each
    excerpt parses; the conversation excerpt is 400 rows from 0 s; where the source is at hand, its rows 16,201 to
    16,600 with the times shifted to the first."""
    readme = (DATA / "README.md").read_text(encoding="utf-8")
    for words in ("Azure LLM inference trace 2023", "CC-BY 4.0", "Splitwise", "Vidur", "MIT"):
        assert words in readme
    shipped = sorted(DATA.glob("*.csv"))
    assert {p.name for p in shipped} >= {Path(p).name for p in bench.TRACES.values()}
    for path in shipped:
        assert path.name in readme
        assert trace_rows(path, 10_000)
    rows = trace_rows(bench.TRACES["azure-conv"], 10_000)
    assert len(rows) == 400 and rows[0][0] == 0.0
    if SOURCE.exists():
        source = trace_rows(SOURCE, 16_600)[16_200:]
        assert [(p, d) for _, p, d in rows] == [(p, d) for _, p, d in source]
        assert [t for t, _, _ in rows] == pytest.approx([t - source[0][0] for t, _, _ in source], abs=1e-6)
