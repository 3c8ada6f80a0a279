"""``nanoverify bench serve``: the server under load over HTTP, as ``vllm bench serve`` measures it.

It spawns ``nanoverify serve`` on a free port (a process of its own, as users run
it), sends the workload through streaming HTTP clients (a minimal HTTP/1.1 client
on asyncio, one connection per request), and prints request and output-token
throughput and TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99).
Arrivals: all at once (``--rate inf``), Poisson/gamma at ``--rate`` requests/s with
``--burstiness`` (1: Poisson; lower: burstier), or a trace's (``--trace-file``, a
CSV with ``arrived_at,num_prefill_tokens,num_decode_tokens``, as the Azure LLM
inference trace 2023 that ships in optimized/benchmarks/data/). Trace lengths are
scaled to the CPU: prompts divided by ``--trace-prompt-scale`` (16), outputs by
``--trace-output-scale`` (2), both at least 1 and cut to ``max_model_len``.
Requests are greedy with ``ignore_eos`` (each yields exactly its length) and ask for
token ids, so every step's tokens arrive in a chunk and are counted exactly. With
``--rate inf`` the same requests then go through ``LLM.generate`` in this process
(after the server has exited, so the two never share the CPU): both output
throughputs and their ratio are printed. ``--compare-check`` instead measures
what ``serve --check`` costs (spec/check.md, CHECK-5): two servers of the same
settings, one with ``--check``, each sent the same workloads in alternation
(unchecked, checked, checked, unchecked per round; the n-th run of each side
gets the n-th workload, so no run finds its prompts cached by the run before);
it prints every run's output tok/s, both medians and checked / unchecked
against the target (at least ``CHECK_TARGET``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from optimized.engine.args import EngineArgs

DATA = Path(__file__).parent / "data"
AZURE_CODE = DATA / "azure-llm-2023-code-first1000.csv"
MODEL_NAME_DEFAULT = "default"
CHECK_TARGET = 0.75  # serve --check keeps at least this share of the unchecked output throughput (CHECK-5)
CHECK_ORDER = (False, True, True, False)  # one round of --compare-check: unchecked, checked, checked, unchecked
CHECK_ROUNDS = 2  # --compare-check's rounds unless --rounds says


@dataclass(frozen=True)
class Job:
    arrival: float  # seconds after the start
    prompt: list[int]
    output_len: int


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # each chunk that brought tokens
    tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.start


# --- workloads ----------------------------------------------------------------------------------------
def random_jobs(n: int, max_input: int, max_output: int, vocab: int, rate: float, burstiness: float,
                seed: int) -> list[Job]:
    """Random prompts (1..max_input tokens) and lengths (1..max_output), arrivals by a gamma process."""
    rng = random.Random(seed)
    arrivals = gamma_arrivals(n, rate, burstiness, rng)
    return [Job(a, [rng.randrange(vocab) for _ in range(rng.randint(1, max_input))], rng.randint(1, max_output))
            for a in arrivals]


def gamma_arrivals(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Arrival times of ``n`` requests at ``rate`` per second (inf: all at 0), gaps ~ Gamma(burstiness)."""
    if math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


Row = tuple[float, int, int]


def trace_rows(path: Path, n: int) -> list[Row]:
    """The first ``n`` rows of a trace CSV (arrived_at, num_prefill_tokens, num_decode_tokens); a ValueError naming
    the file and line when one is missing, not a number, out of order or not CSV/UTF-8 (checked before any model is
    loaded)."""
    rows: list[Row] = []
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        try:
            for row in reader:
                rows.append(_trace_row(path, reader.line_num, row, rows[-1][0] if rows else 0.0))
                if len(rows) == n:
                    break
        except csv.Error as e:  # raised reading the row after the last line counted
            raise ValueError(f"{path}: line {reader.line_num + 1}: {e}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start} of a read)") from None
    if not rows:
        raise ValueError(f"{path}: no requests (columns arrived_at,num_prefill_tokens,num_decode_tokens)")
    return rows


def _trace_row(path: Path, line: int, row: dict[str, str], earliest: float) -> Row:
    try:
        parsed = (float(row["arrived_at"]), int(row["num_prefill_tokens"]), int(row["num_decode_tokens"]))
    except KeyError as e:
        raise ValueError(f"{path}: line {line}: no column {e.args[0]!r} "
                         "(columns arrived_at,num_prefill_tokens,num_decode_tokens)") from None
    except (TypeError, ValueError):
        raise ValueError(f"{path}: line {line}: not a number in {dict(row)!r}") from None
    if not (math.isfinite(parsed[0]) and parsed[1] >= 0 and parsed[2] >= 0):
        raise ValueError(f"{path}: line {line}: a time must be finite and lengths >= 0, got {parsed}")
    if parsed[0] < earliest:
        raise ValueError(f"{path}: line {line}: arrived_at {parsed[0]} is before the line above's {earliest}")
    return parsed


def trace_jobs(rows: list[Row], vocab: int, max_model_len: int, prompt_scale: float, output_scale: float,
               rate: float | None, seed: int) -> list[Job]:
    """The trace's requests, lengths scaled down; ``rate``: replace its arrivals by Poisson ones."""
    rng = random.Random(seed)
    arrivals = gamma_arrivals(len(rows), rate, 1.0, rng) if rate is not None else [r[0] - rows[0][0] for r in rows]
    jobs = []
    for at, prefill, decode in zip(arrivals, (r[1] for r in rows), (r[2] for r in rows), strict=True):
        output = max(1, round(decode / output_scale))
        prompt = max(1, min(round(prefill / prompt_scale), max_model_len - output))
        jobs.append(Job(at, [rng.randrange(vocab) for _ in range(prompt)], output))
    return jobs


# --- the client -----------------------------------------------------------------------------------------
async def send(host: str, port: int, model: str, job: Job, result: Result) -> None:
    """One streamed completion; ``result`` gets the time of every chunk that brought tokens."""
    body = json.dumps({"model": model, "prompt": job.prompt, "max_tokens": job.output_len, "temperature": 0,
                       "ignore_eos": True, "stream": True, "return_token_ids": True}).encode()
    result.start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body))
        await writer.drain()
        status = (await reader.readline()).split(b" ", 2)
        while (await reader.readline()).strip():
            pass  # headers: uvicorn streams with chunked transfer encoding
        if len(status) < 2 or status[1] != b"200":
            result.error = f"HTTP {status[1:2]}: {(await reader.read())[:200]!r}"
            return
        await _read_events(reader, result)
    finally:
        writer.close()


async def _read_events(reader: asyncio.StreamReader, result: Result) -> None:
    pending = b""
    while True:
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            return
        pending += (await reader.readexactly(size + 2))[:-2]
        while b"\n\n" in pending:
            event, pending = pending.split(b"\n\n", 1)
            data = event.removeprefix(b"data: ")
            if data == b"[DONE]":
                result.ok = result.error == ""
                continue
            payload = json.loads(data)
            if "error" in payload:
                result.error = payload["error"]["message"]
                continue
            tokens = len(payload["choices"][0].get("token_ids", []))
            if tokens:
                result.tokens += tokens
                result.chunk_times.append(time.perf_counter())


async def run_clients(host: str, port: int, model: str, jobs: list[Job]) -> tuple[list[Result], float]:
    results = [Result() for _ in jobs]
    start = time.perf_counter()

    async def at_arrival(job: Job, result: Result) -> None:
        await asyncio.sleep(max(0.0, start + job.arrival - time.perf_counter()))
        try:
            await send(host, port, model, job, result)
        except (OSError, ValueError, asyncio.IncompleteReadError) as e:
            result.error = f"{type(e).__name__}: {e}"

    await asyncio.gather(*(at_arrival(j, r) for j, r in zip(jobs, results, strict=True)))
    return results, time.perf_counter() - start


# --- the server process ------------------------------------------------------------------------------------
def server_environment() -> dict[str, str]:
    """This process's environment for the server, this package first on PYTHONPATH, without NANOVERIFY_API_KEY:
    the bench client sends no key."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "NANOVERIFY_API_KEY"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return env


class ServerProcess:
    """``nanoverify serve`` on a free port; with ``ready=False`` started but not waited for (``wait_ready``), so that
    two servers start at once."""

    def __init__(self, flags: list[str], ready: bool = True) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "optimized.cli", "serve", "--port", "0", *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env=server_environment())
        self.host, self.port = "", 0
        self._terminated = False
        if ready:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Until the server listens: its host and port."""
        self.host, self.port = self._bound()

    def _bound(self) -> tuple[str, int]:
        found: list[str] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if "listening on http://" in line:
                    found.append(line.rsplit("http://", 1)[1].strip())
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(300)
        if not found:
            self.stop()
            raise OSError(f"nanoverify serve did not start (exit status {self.proc.poll()})")
        host, port = found[0].rsplit(":", 1)
        return host, int(port)

    def cpu_seconds(self) -> float | None:
        """The CPU time so far (user + system; Linux's /proc) of the server and every process under it (the
        engine process, tensor-parallel workers), None where unknown."""
        try:
            total = _cpu_seconds(self.proc.pid)
            for pid in _process_tree(self.proc.pid)[1:]:
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # one that ended just now
                    total += _cpu_seconds(pid)
            return total
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> None:
        self.terminate()
        self.reap()

    def terminate(self) -> None:
        """SIGTERM, once, if it still runs: the server drains and exits (``reap`` waits for it)."""
        if self.proc.poll() is None and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def reap(self) -> None:
        """Wait up to 30 s for the exit, then kill."""
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants, as Linux lists each thread's children."""
    tree = [pid]
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a process or thread that ended just now
        for task in list(Path(f"/proc/{pid}/task").iterdir()):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                for child in (task / "children").read_text().split():
                    tree += _process_tree(int(child))
    return tree


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- the report --------------------------------------------------------------------------------------------
def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    ordered = sorted(values)

    def at(q: float) -> float:  # linear interpolation, as numpy's default
        pos = q * (len(ordered) - 1)
        low = math.floor(pos)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)

    return {"mean": sum(values) / len(values), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def report(jobs: list[Job], results: list[Result], duration: float) -> float:
    """Print vLLM's serving table; the output-token throughput."""
    done = [r for r in results if r.ok and r.chunk_times]
    failed = len(results) - len(done)
    out_tokens = sum(r.tokens for r in done)
    in_tokens = sum(len(j.prompt) for j, r in zip(jobs, results, strict=True) if r in done)
    ttft = [r.ttft * 1000 for r in done]
    tpot = [(r.e2e - r.ttft) * 1000 / (r.tokens - 1) for r in done if r.tokens > 1]
    itl = [(b - a) * 1000 for r in done for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    e2e = [r.e2e * 1000 for r in done]
    throughput = out_tokens / duration
    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    rows = [("Successful requests:", len(done)), ("Failed requests:", failed),
            ("Benchmark duration (s):", f"{duration:.2f}"), ("Total input tokens:", in_tokens),
            ("Total generated tokens:", out_tokens), ("Request throughput (req/s):", f"{len(done) / duration:.2f}"),
            ("Output token throughput (tok/s):", f"{throughput:.2f}"),
            ("Total token throughput (tok/s):", f"{(in_tokens + out_tokens) / duration:.2f}")]
    for label, value in rows:
        print(f"{label:<40}{value:>10}")
    for title, short, values in (("Time to First Token", "TTFT", ttft), ("Time per Output Token (excl. 1st token)",
                                 "TPOT", tpot), ("Inter-token Latency", "ITL", itl),
                                 ("End-to-end Latency", "E2EL", e2e)):
        print("{s:{c}^50}".format(s=title, c="-"))
        stats = percentiles(values)
        for key, label in (("mean", "Mean"), ("p50", "Median"), ("p90", "P90"), ("p99", "P99")):
            print(f"{f'{label} {short} (ms):':<40}{stats[key]:>10.2f}")
    print("=" * 50)
    errors = {r.error for r in results if r.error}
    if errors:
        print(f"errors: {sorted(errors)[:3]}")
    return throughput


def offline_throughput(llm_kwargs: dict[str, Any], jobs: list[Job]) -> tuple[float, float]:
    """The same requests through ``LLM.generate`` all at once (after a small warm-up): output tokens per second
    of wall time, and per second of this process's CPU time."""
    from optimized import LLM, SamplingParams

    llm = LLM(**llm_kwargs)
    params = [SamplingParams(temperature=0.0, max_tokens=j.output_len, ignore_eos=True) for j in jobs]
    llm.generate([j.prompt for j in jobs[:4]], params[:4], use_tqdm=False)
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate([j.prompt for j in jobs], params, use_tqdm=False)
    tokens = sum(len(o.token_ids) for o in outs)
    return tokens / (time.perf_counter() - start), tokens / (time.process_time() - cpu)


# --- the command -------------------------------------------------------------------------------------------
# The engine settings the command does not pass on: the server and the offline side would record one trace file.
NOT_PASSED = ("trace", "trace_wall_times")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from optimized.engine.arg_types import bounded_int
    from optimized.engine.args import EngineArgs

    EngineArgs.add_cli_args(p, exclude=NOT_PASSED)
    p.add_argument("--rate", type=_rate, default=None,
                   help="requests per second, or inf: all at once (default: inf, or a trace's own arrivals)")
    p.add_argument("--burstiness", type=_positive, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    p.add_argument("--requests", type=bounded_int(1), default=64, help="number of requests (64)")
    p.add_argument("--max-input-len", type=bounded_int(1), default=128, help="random prompts: 1..N tokens (128)")
    p.add_argument("--max-output-len", type=bounded_int(1), default=128, help="random outputs: 1..N tokens (128)")
    p.add_argument("--trace-file", type=Path, default=None, metavar="CSV",
                   help=f"replay a trace's arrivals and lengths ('azure-code': {AZURE_CODE.name})")
    p.add_argument("--trace-prompt-scale", type=_positive, default=16.0, help="trace prompts divided by this (16)")
    p.add_argument("--trace-output-scale", type=_positive, default=2.0, help="trace outputs divided by this (2)")
    p.add_argument("--stream-interval", type=bounded_int(1), default=1, metavar="N",
                   help="the server's --stream-interval (default 1: a chunk every step)")
    p.add_argument("--workload-seed", type=bounded_int(0, 1 << 62), default=0)
    p.add_argument("--compare-check", action="store_true", help="instead of LLM.generate: the server unchecked "
                   "and with --check, the same workloads alternating, and the ratio (spec/check.md)")
    p.add_argument("--rounds", type=bounded_int(1), default=None,
                   help=f"with --compare-check: rounds, each unchecked-checked-checked-unchecked ({CHECK_ROUNDS})")


def _positive(text: str) -> float:
    from optimized.engine.arg_types import positive_seconds

    return positive_seconds(text)


def _rate(text: str) -> float:
    return math.inf if text.strip().lower() in ("inf", "infinity") else _positive(text)


def main(args: argparse.Namespace) -> int:
    from optimized.engine.args import EngineArgs
    from optimized.entry.llm import LLM

    if args.rounds is not None and not args.compare_check:  # refused before any model loads
        raise ValueError("--rounds applies only with --compare-check")
    engine = EngineArgs.from_cli_args(args)
    kwargs = engine.as_kwargs()
    rows = None
    if args.trace_file is not None:  # read and checked first: a bad file is refused before any model loads
        rows = trace_rows(AZURE_CODE if str(args.trace_file) == "azure-code" else args.trace_file, args.requests)
    probe = LLM(**{**kwargs, "num_kvcache_blocks": 1, "check": False})  # vocabulary and max_model_len only
    vocab, max_len = probe.limits.vocab_size, probe.limits.max_model_len
    del probe

    def make_jobs(seed: int) -> list[Job]:
        if rows is not None:
            return trace_jobs(rows, vocab, max_len, args.trace_prompt_scale, args.trace_output_scale, args.rate, seed)
        rate = math.inf if args.rate is None else args.rate
        drawn = random_jobs(args.requests, min(args.max_input_len, max_len - 1), args.max_output_len, vocab,
                            rate, args.burstiness, seed)
        return [Job(j.arrival, j.prompt, min(j.output_len, max_len - len(j.prompt))) for j in drawn]

    model = MODEL_NAME_DEFAULT if args.model is None else Path(args.model).resolve().name
    if args.compare_check:
        return compare_check(args, engine, model, lambda n: make_jobs(args.workload_seed * 1000 + n))
    jobs = make_jobs(args.workload_seed)
    server = ServerProcess(_server_flags(args))
    try:
        warm = [Job(0.0, j.prompt, min(j.output_len, 4)) for j in jobs[:4]]
        asyncio.run(run_clients(server.host, server.port, model, warm))
        cpu_before = server.cpu_seconds()
        results, duration = asyncio.run(run_clients(server.host, server.port, model, jobs))
        cpu_after = server.cpu_seconds()
    finally:
        server.stop()
    served = report(jobs, results, duration)
    served_tokens = sum(r.tokens for r in results if r.ok)
    served_cpu = None if cpu_before is None or cpu_after is None else served_tokens / max(cpu_after - cpu_before,
                                                                                          1e-9)
    if served_cpu is not None:
        print(f"{'Server output per CPU second (tok/s):':<40}{served_cpu:>10.2f}")
    if all(j.arrival == 0 for j in jobs):  # --rate inf: the offline side of the same requests
        offline, offline_cpu = offline_throughput(kwargs, jobs)
        print(f"{'Offline LLM.generate output (tok/s):':<40}{offline:>10.2f}")
        print(f"{'Offline output per CPU second (tok/s):':<40}{offline_cpu:>10.2f}")
        print(f"{'Served / offline (wall):':<40}{served / offline:>10.1%}")
        if served_cpu is not None:
            print(f"{'Served / offline (CPU time):':<40}{served_cpu / offline_cpu:>10.1%}")
    return 0 if all(r.ok for r in results) else 1


def _server_flags(args: argparse.Namespace, engine: EngineArgs | None = None) -> list[str]:
    """The server's flags: every engine setting (the LLM it builds is the offline side's, or ``engine``'s), the
    interval."""
    from optimized.engine.args import EngineArgs

    settings = EngineArgs.from_cli_args(args) if engine is None else engine
    return [*settings.cli_flags(), "--stream-interval", str(args.stream_interval)]


def compare_check(args: argparse.Namespace, engine: EngineArgs, model: str, make_jobs: Callable[[int], list[Job]]
                  ) -> int:
    """Two servers, unchecked and ``--check`` (else ``engine``'s settings), both started and warmed, then sent the
    n-th workload each in ``CHECK_ORDER``; every run printed, then the medians and checked / unchecked output
    throughput. Exit 0 when every request succeeded and the ratio reaches ``CHECK_TARGET``, else 1."""
    rounds = CHECK_ROUNDS if args.rounds is None else args.rounds
    print(f"serve --check's cost (target: checked keeps at least {CHECK_TARGET:.0%} of the unchecked output tok/s), "
          f"{rounds} rounds of {'-'.join('C' if c else 'U' for c in CHECK_ORDER)}, "
          f"check_full_every={engine.check_full_every}")
    servers: dict[bool, ServerProcess] = {}
    try:
        for checked in (False, True):
            flags = _server_flags(args, replace(engine, check=checked))
            print(f"  {'checked  ' if checked else 'unchecked'} server: nanoverify serve {' '.join(flags)}")
            servers[checked] = ServerProcess(flags, ready=False)  # both start at once
        for server in servers.values():
            server.wait_ready()
        warm = [Job(0.0, j.prompt, min(j.output_len, 4)) for j in make_jobs(0)[:4]]
        for server in servers.values():
            asyncio.run(run_clients(server.host, server.port, model, warm))
        rates: dict[bool, list[float]] = {False: [], True: []}
        per_cpu: dict[bool, list[float]] = {False: [], True: []}
        ok = True
        for r in range(rounds):
            for checked in CHECK_ORDER:
                server = servers[checked]
                jobs = make_jobs(len(rates[checked]) + 1)
                cpu_before = server.cpu_seconds()
                results, duration = asyncio.run(run_clients(server.host, server.port, model, jobs))
                cpu_after = server.cpu_seconds()
                tokens = sum(r.tokens for r in results if r.ok)
                failed = sum(not r.ok for r in results)
                ok &= failed == 0
                rates[checked].append(tokens / duration)
                cpu = ""
                if cpu_before is not None and cpu_after is not None:
                    per_cpu[checked].append(tokens / max(cpu_after - cpu_before, 1e-9))
                    cpu = f", {cpu_after - cpu_before:6.2f} s server CPU"
                print(f"  round {r + 1} {'checked  ' if checked else 'unchecked'}: {tokens / duration:8.1f} output "
                      f"tok/s ({tokens} tokens in {duration:.2f} s{cpu}{f', {failed} FAILED' if failed else ''})")
    finally:
        for server in servers.values():  # both drain at once
            server.terminate()
        for server in servers.values():
            server.reap()
    unchecked, checked_rate = statistics.median(rates[False]), statistics.median(rates[True])
    ratio = checked_rate / unchecked if unchecked > 0 else math.nan  # nan: no unchecked token came back
    print(f"  unchecked median {unchecked:.1f} output tok/s, checked median {checked_rate:.1f}: checked keeps "
          f"{ratio:.1%} ({'within' if ratio >= CHECK_TARGET else 'BELOW'} the {CHECK_TARGET:.0%} target)")
    readable = all(len(per_cpu[c]) == len(rates[c]) for c in (False, True))  # every run's server CPU seconds
    unchecked_cpu = statistics.median(per_cpu[False]) if readable else 0.0
    if unchecked_cpu > 0:
        checked_cpu = statistics.median(per_cpu[True])
        print(f"  per server CPU second: unchecked median {unchecked_cpu:.1f} output tok/s, checked median "
              f"{checked_cpu:.1f}: checked keeps {checked_cpu / unchecked_cpu:.1%}")
    return 0 if ok and ratio >= CHECK_TARGET else 1
