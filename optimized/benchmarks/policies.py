"""``nanoverify bench policies``: one seeded workload replayed through every scheduling policy on the real engine.

Invariant: every policy of a run gets the same requests (the same prompts, lengths and arrival times) on an engine
of the same settings, built fresh for it (an empty prefix cache), warmed by the same few requests, one policy after
the other in one process; only ``scheduling_policy`` differs. A request is added (``LLM.add_request``) when its
arrival time has passed on the wall clock, and ``LLM.step`` runs while anything is queued, so a request that arrives
during a step waits for it, as it would behind a server's loop. Every latency counts from the request's arrival
time, not from when it was added: TTFT is arrival to first token, each TBT gap is the time between two consecutive
tokens of one request (a token's time is the end of the step that made it), E2E is arrival to last token.
Percentiles interpolate linearly between order statistics (numpy's default; ``serve.percentiles``); the TBT
percentiles and the TBT max (the longest gap) pool every gap of every request. Goodput is the share of requests
that met both SLOs: TTFT <= ``slo_ttft`` and their largest gap <= ``slo_tbt`` (every gap, not a percentile of
them). Prefix-cache hit rate is the share of the tokens looked up in the prefix cache that it held
(``EngineStats``), preemptions are the engine's count, output tok/s is every output token over the time from the
start to the last token; each is the timed replay's only (the warm-up's subtracted). The ratio of each column to
the lesson's, from the same run, follows.
``--rounds N`` replays every policy N times, the order reversed every other round (so that a neighbour's load on a
shared machine falls on every policy alike), and reports each column's median over the rounds; a policy that
decides as the lesson on the workload (priority with every priority 0, lpm without a single prefix hit) is named,
its ratios being the run's noise.

Workloads. A trace (``--trace-file``: the shipped excerpts ``azure-conv``, the default, and ``azure-code``, or any
CSV with ``arrived_at,num_prefill_tokens,num_decode_tokens``; optimized/benchmarks/data/README.md): its first
``--requests`` rows; lengths divided by ``--prompt-scale`` and ``--output-scale`` and clamped (``scale_lengths``);
arrival times rescaled by one factor so that the mean rate over the window is ``--rate`` R requests/s (5 by
default), every gap keeping its share of the whole (the burst shape; ``rescale_arrivals``), or with ``--rate
recorded`` as recorded. ``--shared-prefix``: ``--prefixes`` distinct system prompts of ``--prefix-len`` tokens,
each request one of them (drawn from the seed, so they interleave) and a suffix of its own, Poisson arrivals at
``--rate`` (16/s by default), and by default a KV cache that holds two of the system prompts beside six requests'
own tokens, so that the order of admission decides what stays cached (POLICY-9). Prompt tokens are drawn from
``--workload-seed``; every request is greedy with ``ignore_eos``, so it yields exactly its length under every
policy. ``--plot`` draws each policy's TTFT and TBT CDFs (its rounds pooled) and each policy's timeline side by
side (its first round; one row per request: waiting until its first token, then each gap between tokens, red when
it exceeds ``slo_tbt``), from the same measurements.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optimized.benchmarks import serve
from optimized.benchmarks.serve import Job, Row, percentiles, trace_rows
from optimized.core.config import POLICIES

if TYPE_CHECKING:
    from optimized.entry.llm import LLM

TRACES = {"azure-conv": serve.DATA / "azure-llm-2023-conv-16201-16600.csv", "azure-code": serve.AZURE_CODE}
BASELINE = "lesson"
# The engine settings this bench has its own defaults for: a token budget of 256 (a prompt chunked at 256 tokens a
# step, about 25 ms of the default model's prefill on this CPU), as chunked prefill is meant to be used.
ENGINE_DEFAULTS = {"max_num_batched_tokens": 256}
# Not passed on: a policy per engine is this command's own choice, and one trace file cannot record several runs.
NOT_PASSED = ("trace", "trace_wall_times", "scheduling_policy")
WARMUP_REQUESTS = 4
# The trace's defaults: its first 100 rows at a mean of 5 requests/s (near the recorded 5.4/s), which this CPU
# serves under every policy, the lesson's prefill steps stalling its decodes often enough to set its p99 TBT (at 3/s
# the stalls are under 1% of the gaps); the shared-prefix workload's rate, over what the lesson's order sustains.
DEFAULT_REQUESTS = 100
DEFAULT_RATE = 5.0
RECORDED = "recorded"
SHARED_PREFIX_RATE = 16.0
CDF_QUANTILES = ("p50", "p90", "p99")


# --- the workloads -------------------------------------------------------------------------------------------------
def scale_lengths(prefill: int, decode: int, prompt_scale: float, output_scale: float,
                  max_model_len: int) -> tuple[int, int]:
    """A trace row's lengths on this engine: output = round(decode / output_scale), at least 1 and at most
    max_model_len - 1; prompt = round(prefill / prompt_scale), at least 1 and at most max_model_len - output."""
    output = min(max(1, round(decode / output_scale)), max_model_len - 1)
    prompt = min(max(1, round(prefill / prompt_scale)), max_model_len - output)
    return prompt, output


def rescale_arrivals(times: list[float], rate: float | None) -> list[float]:
    """Times from the first arrival; with ``rate``, multiplied by one factor so that the mean rate, (n - 1) requests
    over the span from the first arrival to the last, is ``rate`` per second. ValueError naming --rate when there is
    no span to rescale (one request, or all at one instant)."""
    start = times[0]
    shifted = [t - start for t in times]
    if rate is None:
        return shifted
    span = shifted[-1]
    if len(times) < 2 or span <= 0:
        raise ValueError("--rate: the trace's requests all arrive at one instant; there is no rate to rescale")
    factor = (len(times) - 1) / (span * rate)
    return [t * factor for t in shifted]


def trace_workload(rows: list[Row], vocab: int, max_model_len: int, prompt_scale: float, output_scale: float,
                   rate: float | None, seed: int) -> list[Job]:
    """The trace's requests: its arrivals (``rescale_arrivals``), its lengths scaled (``scale_lengths``), prompt
    tokens drawn from ``seed``."""
    rng = random.Random(seed)
    arrivals = rescale_arrivals([r[0] for r in rows], rate)
    jobs = []
    for at, (_, prefill, decode) in zip(arrivals, rows, strict=True):
        prompt, output = scale_lengths(prefill, decode, prompt_scale, output_scale, max_model_len)
        jobs.append(Job(at, [rng.randrange(vocab) for _ in range(prompt)], output))
    return jobs


def shared_prefix_workload(n: int, prefixes: int, prefix_len: int, vocab: int, max_model_len: int, rate: float,
                           seed: int) -> list[Job]:
    """``n`` requests, each one of ``prefixes`` system prompts of ``prefix_len`` tokens (drawn), then 16..64 tokens
    of its own, asking 8..32 tokens; Poisson arrivals at ``rate``. ValueError naming --prefix-len when a request
    would not fit ``max_model_len``."""
    longest = prefix_len + 64 + 32
    if longest > max_model_len:
        raise ValueError(f"--prefix-len: {prefix_len} + 64 suffix + 32 output tokens exceed max_model_len "
                         f"{max_model_len}")
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(prefix_len)] for _ in range(prefixes)]
    arrivals = serve.gamma_arrivals(n, rate, 1.0, rng)
    jobs = []
    for at in arrivals:
        own = [rng.randrange(vocab) for _ in range(rng.randint(16, 64))]
        jobs.append(Job(at, systems[rng.randrange(prefixes)] + own, rng.randint(8, 32)))
    return jobs


SHARED_PREFIX_SEATS = 6  # the default cache's room for requests' own tokens, beside two system prompts


def shared_prefix_blocks(prefix_len: int, block_size: int) -> int:
    """The shared-prefix workload's default KV cache: two system prompts' blocks and six requests' own suffix and
    output (96 tokens each): too small to keep every system prompt cached, so the order of admission decides."""
    return 2 * math.ceil(prefix_len / block_size) + SHARED_PREFIX_SEATS * math.ceil(96 / block_size)


# --- one policy's replay -------------------------------------------------------------------------------------------
@dataclass
class Timing:
    """One request's arrival and the time each of its tokens came, seconds from the replay's start."""

    arrival: float
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_times)]


@dataclass(frozen=True)
class Counters:
    preemptions: int
    hit_tokens: int
    query_tokens: int

    @staticmethod
    def of(llm: LLM) -> Counters:
        st = llm.stats
        return Counters(st.preemptions, st.prefix_cache_hit_tokens, st.prefix_cache_query_tokens)

    def __sub__(self, other: Counters) -> Counters:
        return Counters(self.preemptions - other.preemptions, self.hit_tokens - other.hit_tokens,
                        self.query_tokens - other.query_tokens)


@dataclass(frozen=True)
class Replay:
    policy: str
    timings: list[Timing]
    counters: Counters

    @property
    def duration(self) -> float:
        return max(t.token_times[-1] for t in self.timings)

    @property
    def output_tokens(self) -> int:
        return sum(len(t.token_times) for t in self.timings)


def replay(llm: LLM, policy: str, jobs: list[Job]) -> Replay:
    """Add each job when its arrival time has passed, step while anything is queued, and time every token."""
    from optimized.engine.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=j.output_len, ignore_eos=True) for j in jobs]
    timings = [Timing(j.arrival) for j in jobs]
    live: dict[int, Timing] = {}
    before = Counters.of(llm)
    clock = time.perf_counter
    start = clock()
    added = 0
    while added < len(jobs) or live:
        now = clock() - start
        while added < len(jobs) and jobs[added].arrival <= now:
            live[llm.add_request(jobs[added].prompt, params[added])] = timings[added]
            added += 1
        if not live:  # idle until the next arrival
            time.sleep(max(0.0, jobs[added].arrival - (clock() - start)))
            continue
        outputs = llm.step()
        done = clock() - start
        for rid, timing in live.items():
            new = llm.completion_tokens(rid, len(timing.token_times))
            if new:
                timing.token_times += [done] * len(new)
        for out in outputs:
            timing = live.pop(out.request_id)
            timing.token_times += [done] * (len(out.token_ids) - len(timing.token_times))
    return Replay(policy, timings, Counters.of(llm) - before)


def warm_up(llm: LLM, vocab: int, seed: int) -> None:
    """A few short requests through the engine before it is timed (the same for every policy)."""
    from optimized.engine.sampling_params import SamplingParams

    rng = random.Random(seed ^ 0x5EED)
    prompts = [[rng.randrange(vocab) for _ in range(24)] for _ in range(WARMUP_REQUESTS)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)


# --- the report ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Summary:
    policy: str
    ttft: dict[str, float]  # seconds: mean, p50, p90, p99
    tbt: dict[str, float]  # and max: the longest gap of all
    e2e: dict[str, float]
    goodput: float  # share of requests meeting both SLOs
    preemptions: float  # a median over rounds may fall between two counts
    hit_rate: float  # nan when nothing was looked up
    output_tps: float


def goodput(timings: list[Timing], slo_ttft: float, slo_tbt: float) -> float:
    """The share of requests with TTFT <= slo_ttft and every TBT gap <= slo_tbt (a one-token request has none)."""
    met = sum(t.ttft <= slo_ttft and max(t.gaps, default=0.0) <= slo_tbt for t in timings)
    return met / len(timings)


def summarize(r: Replay, slo_ttft: float, slo_tbt: float) -> Summary:
    c = r.counters
    gaps = [g for t in r.timings for g in t.gaps]
    return Summary(r.policy, percentiles([t.ttft for t in r.timings]),
                   {**percentiles(gaps), "max": max(gaps, default=math.nan)}, percentiles([t.e2e for t in r.timings]),
                   goodput(r.timings, slo_ttft, slo_tbt), c.preemptions,
                   c.hit_tokens / c.query_tokens if c.query_tokens else math.nan, r.output_tokens / r.duration)


# (header, what it reads, format of a value): the columns, in order; latencies in milliseconds
COLUMNS: tuple[tuple[str, str, str], ...] = (
    *((f"TTFT {q}", f"ttft.{q}", "ms") for q in CDF_QUANTILES), ("TTFT mean", "ttft.mean", "ms"),
    *((f"TBT {q}", f"tbt.{q}", "ms") for q in CDF_QUANTILES), ("TBT max", "tbt.max", "ms"),
    *((f"E2E {q}", f"e2e.{q}", "ms") for q in CDF_QUANTILES),
    ("goodput", "goodput", "%"), ("preempt", "preemptions", "n"), ("hit rate", "hit_rate", "%"),
    ("out tok/s", "output_tps", "f"),
)


def value(s: Summary, key: str) -> float:
    """The column ``key`` of ``s`` ('tbt.p99', 'goodput', ...)."""
    if "." in key:
        metric, q = key.split(".")
        stats: dict[str, float] = getattr(s, metric)
        return stats[q]
    number: float = getattr(s, key)
    return number


def _shown(v: float, kind: str) -> str:
    if math.isnan(v):
        return "n/a"
    return {"ms": f"{v * 1000:.1f}", "%": f"{v:.1%}", "n": f"{v:g}", "f": f"{v:.1f}"}[kind]


def ratio(a: float, b: float) -> float:
    """a / b, nan when b is 0 or either is nan."""
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else math.nan


def table(summaries: list[Summary]) -> list[str]:
    """Each policy's line (latencies in ms), then each policy's ratios to the lesson's (when it ran)."""
    width = max(10, *(len(h) + 1 for h, _, _ in COLUMNS))
    head = f"{'policy':<10}" + "".join(f"{h:>{width}}" for h, _, _ in COLUMNS)
    lines = [head]
    for s in summaries:
        lines.append(f"{s.policy:<10}" + "".join(f"{_shown(value(s, k), kind):>{width}}" for _, k, kind in COLUMNS))
    base = next((s for s in summaries if s.policy == BASELINE), None)
    if base is not None and len(summaries) > 1:
        lines.append(f"ratio to {BASELINE} (this run):")
        for s in summaries:
            if s is base:
                continue
            cells = (_ratio_cell(ratio(value(s, k), value(base, k))) for _, k, _ in COLUMNS)
            lines.append(f"{s.policy:<10}" + "".join(f"{c:>{width}}" for c in cells))
    return lines


def _ratio_cell(r: float) -> str:
    return "n/a" if math.isnan(r) else f"{r:.2f}x"


# --- the figure ----------------------------------------------------------------------------------------------------
def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend; ValueError naming --plot and the ``plot`` extra without it."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: install the plot extra (pip install 'nanoverify[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(runs: list[list[Replay]], slo_ttft: float, slo_tbt: float, path: Path, title: str) -> None:
    """Top: the TTFT and the TBT CDF of every policy (each policy's rounds pooled); below: each policy's timeline
    (its first round), side by side on one axis."""
    replays = [rounds[0] for rounds in runs]
    plt = pyplot()
    from matplotlib.collections import LineCollection

    fig = plt.figure(figsize=(max(11.0, 3.4 * len(replays)), 10.0), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[1.0, 1.5])
    cdfs = top.subplots(1, 2)
    for ax, what, slo in ((cdfs[0], "TTFT", slo_ttft), (cdfs[1], "TBT (every gap between two tokens)", slo_tbt)):
        for rounds in runs:
            timings = [t for r in rounds for t in r.timings]
            values = sorted([t.ttft for t in timings] if what == "TTFT" else [g for t in timings for g in t.gaps])
            if values:
                ax.step([v * 1000 for v in values], [(k + 1) / len(values) for k in range(len(values))],
                        where="post", label=rounds[0].policy)
        ax.axvline(slo * 1000, color="black", linestyle="--", linewidth=0.8, label="SLO")
        ax.set_xscale("log")
        ax.set_xlabel(f"{what}, ms (log)")
        ax.set_ylabel("share of " + ("requests" if what == "TTFT" else "gaps"))
        ax.set_ylim(0, 1.01)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    top.suptitle(title, fontsize=9)
    axes = bottom.subplots(1, len(replays), sharex=True, sharey=True, squeeze=False)[0]
    for ax, r in zip(axes, replays, strict=True):
        waits: list[list[tuple[float, int]]] = []
        fast: list[list[tuple[float, int]]] = []
        slow: list[list[tuple[float, int]]] = []
        for row, t in enumerate(r.timings):
            waits.append([(t.arrival, row), (t.token_times[0], row)])
            for a, b in itertools.pairwise(t.token_times):
                (slow if b - a > slo_tbt else fast).append([(a, row), (b, row)])
        for segments, colour in ((waits, "#c9c9c9"), (fast, "#3c8d3c"), (slow, "#cc2936")):
            ax.add_collection(LineCollection(segments, colors=colour, linewidths=1.2))
        ax.autoscale()
        ax.set_ylim(len(r.timings), -1)
        p99 = percentiles([g for t in r.timings for g in t.gaps])["p99"]
        ax.set_title(f"{r.policy}: p99 TBT {p99 * 1000:.0f} ms", fontsize=9)
        ax.set_xlabel("seconds")
    axes[0].set_ylabel("request (arrival order)")
    bottom.suptitle(f"grey: arrival to first token; green: a gap between tokens <= {slo_tbt * 1000:.0f} ms; "
                    "red: a longer gap", fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the command ---------------------------------------------------------------------------------------------------
def policy_list(text: str) -> list[str]:
    """'all' or comma-separated policy names, each once."""
    if text.strip() == "all":
        return list(POLICIES)
    names = [name.strip() for name in text.split(",")]
    for name in names:
        if name not in POLICIES:
            raise argparse.ArgumentTypeError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)}, or all)")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a policy is named twice in {text!r}")
    return names


def _positive(text: str) -> float:
    from optimized.engine.arg_types import positive_seconds

    return positive_seconds(text)


def _rate(text: str) -> float | str:
    return RECORDED if text.strip() == RECORDED else _positive(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from optimized.engine.arg_types import bounded_int
    from optimized.engine.args import EngineArgs

    EngineArgs.add_cli_args(p, ENGINE_DEFAULTS, exclude=NOT_PASSED)
    p.add_argument("--trace-file", default=None, metavar="CSV",
                   help=f"the trace replayed: {', '.join(TRACES)} (the shipped excerpts, optimized/benchmarks/data/) "
                   "or a CSV of arrived_at,num_prefill_tokens,num_decode_tokens (default: azure-conv)")
    p.add_argument("--requests", type=bounded_int(1), default=DEFAULT_REQUESTS,
                   help=f"the trace's first N rows, or --shared-prefix's requests ({DEFAULT_REQUESTS})")
    p.add_argument("--rate", type=_rate, default=None, metavar="R",
                   help=f"arrivals rescaled to a mean of R requests/s, the bursts kept, or 'recorded': the trace's "
                   f"own times (default {DEFAULT_RATE:g}; --shared-prefix: Poisson at {SHARED_PREFIX_RATE:g}/s)")
    p.add_argument("--prompt-scale", type=_positive, default=4.0, help="trace prompts divided by this (4)")
    p.add_argument("--output-scale", type=_positive, default=2.0, help="trace outputs divided by this (2)")
    p.add_argument("--slo-ttft", type=_positive, default=1.0, metavar="S", help="goodput's TTFT SLO, seconds (1.0)")
    p.add_argument("--slo-tbt", type=_positive, default=0.05, metavar="S",
                   help="goodput's TBT SLO, seconds: every gap of a request at most this (0.05)")
    p.add_argument("--policies", type=policy_list, default=list(POLICIES), metavar="P,Q,...",
                   help=f"the policies run, in this order ({','.join(POLICIES)}; default all)")
    p.add_argument("--plot", type=Path, default=None, metavar="OUT.png",
                   help="draw the TTFT and TBT CDFs and the timelines (needs the plot extra)")
    p.add_argument("--shared-prefix", action="store_true",
                   help="instead of a trace: --prefixes system prompts of --prefix-len tokens, interleaved")
    p.add_argument("--prefixes", type=bounded_int(1), default=4, help="--shared-prefix: system prompts (4)")
    p.add_argument("--prefix-len", type=bounded_int(1), default=512, help="--shared-prefix: their length (512)")
    p.add_argument("--workload-seed", type=bounded_int(0, 1 << 62), default=0)
    p.add_argument("--rounds", type=bounded_int(1, 100), default=1,
                   help="replays per policy, in alternating order (every policy, then every policy backwards, ...); "
                   "each column the median of the rounds (1)")


def main(args: argparse.Namespace) -> int:
    from optimized.engine.args import EngineArgs
    from optimized.entry.llm import LLM

    engine = EngineArgs.from_cli_args(args)
    kwargs = engine.as_kwargs()
    if args.plot is not None:
        pyplot()  # refused before any model loads
    rows: list[Row] | None = None
    if args.shared_prefix:
        if args.trace_file is not None:
            raise ValueError("--trace-file: not with --shared-prefix, whose workload is drawn")
        if args.rate == RECORDED:
            raise ValueError("--rate: 'recorded' needs a trace; --shared-prefix draws Poisson arrivals")
        if kwargs.get("num_kvcache_blocks") is None:
            kwargs["num_kvcache_blocks"] = shared_prefix_blocks(args.prefix_len, engine.kvcache_block_size)
    else:
        name = "azure-conv" if args.trace_file is None else args.trace_file
        path = TRACES.get(name, Path(name))
        try:
            rows = trace_rows(path, args.requests)
        except OSError as e:
            raise ValueError(f"--trace-file: {path}: {e.strerror or e}") from None
        except ValueError as e:
            raise ValueError(f"--trace-file: {e}") from None
    jobs: list[Job] = []
    runs: dict[str, list[Replay]] = {policy: [] for policy in args.policies}
    for k in range(args.rounds):
        for policy in args.policies if k % 2 == 0 else args.policies[::-1]:  # neither end always first
            llm = LLM(**{**kwargs, "scheduling_policy": policy})
            try:
                vocab, max_len = llm.limits.vocab_size, llm.limits.max_model_len
                if not jobs:
                    jobs = (trace_workload(rows, vocab, max_len, args.prompt_scale, args.output_scale,
                                           trace_rate(args.rate), args.workload_seed) if rows is not None else
                            shared_prefix_workload(args.requests, args.prefixes, args.prefix_len, vocab, max_len,
                                                   SHARED_PREFIX_RATE if args.rate is None else args.rate,
                                                   args.workload_seed))
                    print(describe(args, jobs, kwargs))
                warm_up(llm, vocab, args.workload_seed)
                r = replay(llm, policy, jobs)
            finally:
                llm.close()
            runs[policy].append(r)
            one = summarize(r, args.slo_ttft, args.slo_tbt)
            print(f"  {policy} (round {k + 1}/{args.rounds}): {len(r.timings)} requests, {r.output_tokens} output "
                  f"tokens in {r.duration:.2f} s; p99 TBT {one.tbt['p99'] * 1000:.1f} ms, mean TTFT "
                  f"{one.ttft['mean'] * 1000:.1f} ms, hit rate {_shown(one.hit_rate, '%')}", flush=True)
    summaries = [median_summary([summarize(r, args.slo_ttft, args.slo_tbt) for r in runs[p]]) for p in args.policies]
    if args.rounds > 1:
        print(f"each column the median of the {args.rounds} rounds:")
    firsts = [runs[p][0] for p in args.policies]
    for line in table(summaries) + same_as_lesson(firsts) + targets(summaries, args.shared_prefix):
        print(line)
    if args.plot is not None:
        plot([runs[p] for p in args.policies], args.slo_ttft, args.slo_tbt, args.plot, describe(args, jobs, kwargs))
        print(f"figure: {args.plot}")
    return 0


def median_summary(rounds: list[Summary]) -> Summary:
    """Each column's median over the rounds of one policy (the summary itself for one round)."""
    if len(rounds) == 1:
        return rounds[0]

    def median(values: list[float]) -> float:
        return statistics.median(values) if not any(math.isnan(v) for v in values) else math.nan

    def each(metric: str) -> dict[str, float]:
        stats: list[dict[str, float]] = [getattr(r, metric) for r in rounds]
        return {q: median([d[q] for d in stats]) for q in stats[0]}

    return Summary(rounds[0].policy, each("ttft"), each("tbt"), each("e2e"), median([r.goodput for r in rounds]),
                   median([r.preemptions for r in rounds]), median([r.hit_rate for r in rounds]),
                   median([r.output_tps for r in rounds]))


def same_as_lesson(replays: list[Replay]) -> list[str]:
    """A note for each policy that decided as the lesson on this workload, whose differences are then noise."""
    notes = []
    for r in replays:
        if r.policy == "priority":  # the bench gives every request the default priority
            notes.append("note: under priority every request here has priority 0, so it decides every step as the "
                         "lesson (POLICY-5): its ratios measure this run's noise")
        if r.policy == "lpm" and r.counters.hit_tokens == 0:
            notes.append("note: under lpm no prompt here found a cached prefix, so it kept the lesson's order "
                         "(POLICY-8): its ratios measure this run's noise")
    return notes


def targets(summaries: list[Summary], shared_prefix: bool) -> list[str]:
    """POLICY-19's comparisons, both sides and the ratio, when the run holds them: on a trace, mixed against the
    lesson (p99 TBT, output tok/s; and the lesson's p99 / p50 TBT, the regime); on the shared-prefix workload, lpm
    against the lesson (hit rate, mean TTFT)."""
    by = {s.policy: s for s in summaries}
    base = by.get(BASELINE)
    if base is None:
        return []
    lines = []
    if not shared_prefix and "mixed" in by:
        m = by["mixed"]
        lines.append(f"target (POLICY-19): p99 TBT mixed {m.tbt['p99'] * 1000:.1f} ms vs lesson "
                     f"{base.tbt['p99'] * 1000:.1f} ms ({_ratio_cell(ratio(m.tbt['p99'], base.tbt['p99']))}); output "
                     f"tok/s mixed {m.output_tps:.1f} vs lesson {base.output_tps:.1f} "
                     f"({_ratio_cell(ratio(m.output_tps, base.output_tps))}); the lesson's p99 / p50 TBT "
                     f"{_ratio_cell(ratio(base.tbt['p99'], base.tbt['p50']))}")
    if shared_prefix and "lpm" in by:
        lpm = by["lpm"]
        lines.append(f"target (POLICY-19): prefix-cache hit rate lpm {lpm.hit_rate:.1%} vs lesson {base.hit_rate:.1%} "
                     f"({_ratio_cell(ratio(lpm.hit_rate, base.hit_rate))}); mean TTFT lpm "
                     f"{lpm.ttft['mean'] * 1000:.1f} ms vs lesson {base.ttft['mean'] * 1000:.1f} ms "
                     f"({_ratio_cell(ratio(lpm.ttft['mean'], base.ttft['mean']))})")
    return lines


def trace_rate(rate: float | str | None) -> float | None:
    """--rate for a trace: None (the default) is DEFAULT_RATE, 'recorded' the trace's own times (None)."""
    if rate is None:
        return DEFAULT_RATE
    return None if rate == RECORDED else float(rate)


def describe(args: argparse.Namespace, jobs: list[Job], kwargs: dict[str, Any]) -> str:
    """The workload and the settings, one line each."""
    span = jobs[-1].arrival - jobs[0].arrival
    rate = (len(jobs) - 1) / span if span > 0 else math.inf
    prompts, outputs = sorted(len(j.prompt) for j in jobs), sorted(j.output_len for j in jobs)
    if args.shared_prefix:
        what = (f"shared prefix: {args.prefixes} system prompts of {args.prefix_len} tokens, Poisson arrivals, "
                f"workload seed {args.workload_seed}")
    else:
        what = (f"trace {args.trace_file or 'azure-conv'}: first {len(jobs)} rows, prompts / {args.prompt_scale:g}, "
                f"outputs / {args.output_scale:g}, arrivals "
                f"{'as recorded' if trace_rate(args.rate) is None else f'rescaled to {trace_rate(args.rate):g}/s'}, "
                f"workload seed {args.workload_seed}")
    settings = ", ".join(f"{k}={kwargs[k]}" for k in ("max_num_batched_tokens", "max_num_seqs", "num_kvcache_blocks")
                         if k in kwargs)
    return (f"{what}\n{len(jobs)} requests over {span:.1f} s ({rate:.2f}/s), prompts {prompts[0]}..{prompts[-1]} "
            f"tokens (median {prompts[len(prompts) // 2]}), outputs {outputs[0]}..{outputs[-1]} (median "
            f"{outputs[len(outputs) // 2]})\nSLOs: TTFT <= {args.slo_ttft:g} s, every TBT gap <= {args.slo_tbt:g} s; "
            f"{settings}")
