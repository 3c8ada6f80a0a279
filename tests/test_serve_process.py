"""The engine in a process of its own (SERVE-2): what a user sees of the two processes of ``nanoverify serve``.

Spawned servers on a tiny checkpoint: the engine process is found through Linux's /proc, killed, or left behind by
a killed server; Ctrl-C reaches both processes of a foreground job and only the server acts on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from optimized import LLM, SamplingParams
from optimized.cli import main as cli_main
from optimized.engine.engine import EngineStats
from optimized.engine.validation import EngineLimits, RequestRefused
from optimized.entry.llm import EngineState, Gauges, RequestOutput
from optimized.serve.engine_process import (
    AbortAll,
    Cancel,
    EngineProcess,
    Events,
    Failed,
    NotBuilt,
    ReadState,
    Ready,
    StateAnswer,
    Stop,
    Submit,
)
from optimized.serve.loop import EngineInfo, FailEvent, FinishEvent, Stream, TokenEvent, Unavailable
from optimized.serve.metrics import Admitted, AfterStep, Diverged, Finished, Generated, Lost, Metrics, MetricUpdate
from tests.engine_fixtures import with_config
from tests.test_serve import ROOT, Served, spawn, stop

pytestmark = pytest.mark.usefixtures("engine_env")


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (every thread's children, as /proc lists them)."""
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


def engine_pid(served: Served) -> int:
    """The one spawned process under the server (multiprocessing's resource tracker aside)."""
    found = [pid for pid in children(served.proc.pid)
             if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(found) == 1, f"the server should have exactly one engine process: {found}"
    return found[0]


def gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":  # exited, not yet reaped by its parent
            return True
        time.sleep(0.05)
    return False


def kill(served: Served, engine: int | None = None) -> None:
    """The server and its engine process, whatever of them is still there (only a live engine process: a pid
    that ended may have been given to another process since)."""
    engines = [] if engine is None else [engine]
    if served.proc.poll() is None:
        with contextlib.suppress(OSError):
            engines += children(served.proc.pid)
        served.proc.kill()
        served.proc.wait()
    for pid in engines:
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)


def stream_in_background(url: str, model: str, max_tokens: int) -> tuple[threading.Thread, threading.Event,
                                                                          list[str]]:
    """A streamed completion in a thread: its SSE data lines (then "(connection lost)" if the server vanished),
    and an event set at the first one."""
    lines: list[str] = []
    first = threading.Event()

    def run() -> None:
        body = {"model": model, "prompt": [1, 2, 3], "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "return_token_ids": True}  # a chunk every step, text or not
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        first.set()
        except httpx.RemoteProtocolError:  # the server was killed mid-answer
            lines.append("(connection lost)")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, first, lines


@pytest.mark.clause("SERVE-2", "SERVE-12", "SERVE-20")
def test_a_killed_engine_process_fails_its_requests_and_turns_health_503(serve_cache: Path) -> None:
    """SERVE-2: the engine runs in the server's one child process. SERVE-12: when that process dies, a stream in
    flight ends with an error event that says so, /health is 503 with the reason, new requests are 503, and the
    server still shuts down. SERVE-20: the gauges drop to 0 (they read 1 running and blocks in use before), and
    SIGTERM then ends the server with status 3, not 0."""
    folder = with_config("qwen3", "engine-process", max_position_embeddings=8192)
    served = spawn(["--model", str(folder)], serve_cache / "engine-killed.log")
    try:
        engine = engine_pid(served)
        thread, first, lines = stream_in_background(served.url, folder.name, 8000)
        assert first.wait(60)
        before = served.get("/metrics").text
        assert metric_value(before, "nanoverify:num_requests_running") == 1
        assert metric_value(before, "nanoverify:kv_cache_usage_perc") > 0
        os.kill(engine, signal.SIGKILL)
        thread.join(30)
        assert lines[-1] == "[DONE]", lines[-3:]
        error = json.loads(lines[-2]).get("error")
        assert error is not None, lines[-3:]
        assert error["type"] == "server_error" and "engine process ended unexpectedly" in error["message"]
        health = served.get("/health")
        assert health.status_code == 503 and "engine process ended unexpectedly" in health.json()["status"]
        late = httpx.post(served.url + "/v1/completions", json={"model": folder.name, "prompt": [1], "max_tokens": 2})
        assert late.status_code == 503 and "no longer trusted" in late.json()["error"]["message"]
        after = served.get("/metrics").text
        for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert metric_value(after, "nanoverify:" + gauge) == 0, gauge
    finally:
        status = stop(served)
    assert status == 3


@pytest.mark.clause("SERVE-2")
def test_a_killed_server_leaves_no_engine_behind(serve_cache: Path) -> None:
    """SERVE-2: the engine process ends when the server's end of the pipe closes, even when the server was killed
    outright (SIGKILL: nothing of the server ran)."""
    folder = with_config("qwen3", "engine-process", max_position_embeddings=8192)
    served = spawn(["--model", str(folder)], serve_cache / "server-killed.log")
    engine: int | None = None
    try:
        engine = engine_pid(served)
        thread, first, lines = stream_in_background(served.url, folder.name, 8000)  # the engine is busy stepping
        assert first.wait(60)
        served.proc.kill()
        served.proc.wait()
        assert gone(engine, 30), "the engine process outlived its server"
        thread.join(30)
        assert lines[-1] == "(connection lost)"
        log = served.log.read_text()  # the engine process's stderr too: it went quietly, with no alarm raised
        assert "ERROR" not in log and "Traceback" not in log, log
    finally:
        kill(served, engine)


@pytest.mark.clause("SERVE-8")
def test_ctrl_c_to_the_foreground_job_drains_like_sigterm(serve_cache: Path) -> None:
    """SERVE-8: Ctrl-C sends SIGINT to every process of the foreground job, the engine process too; only the server
    acts on it: the stream in flight completes (finish_reason "length"), and both processes exit, the server with
    status 0. The grace period is ample: the default 10 s held 2,000 tokens at 200 tok/s, not on a loaded machine."""
    folder = with_config("qwen3", "engine-process", max_position_embeddings=8192)
    served = spawn(["--model", str(folder), "--shutdown-timeout", "120"], serve_cache / "ctrl-c.log",
                   own_session=True)
    engine: int | None = None
    try:
        engine = engine_pid(served)
        thread, first, lines = stream_in_background(served.url, folder.name, 600)
        assert first.wait(60)
        os.killpg(served.proc.pid, signal.SIGINT)
        at_signal = len(lines)
        thread.join(60)
        assert len(lines) > at_signal + 2  # it was in flight: tokens came after the signal
        assert served.proc.wait(30) == 0
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["choices"][0]["finish_reason"] == "length", lines[-3:]
        assert gone(engine, 30)
    finally:
        kill(served, engine)


def metric_value(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


@pytest.mark.clause("SERVE-13")
def test_the_engine_processes_counts_reach_metrics_before_the_answers(serve_cache: Path) -> None:
    """SERVE-13: the engine process's counters cross the pipe ahead of the events they concern: once every
    client has its whole answer, /metrics counts exactly their prompt and generated tokens and finishes, the
    gauges say nothing runs, and the engine (read between steps) holds every block free of requests."""
    folder = with_config("qwen3", "engine-process", max_position_embeddings=8192)
    served = spawn(["--model", str(folder), "--num-kvcache-blocks", "64"], serve_cache / "metrics.log")
    jobs = [([1 + i] * (3 + 5 * i), 7 + 11 * i) for i in range(6)]  # (prompt ids, max_tokens)
    try:
        def ask(job: tuple[list[int], int]) -> int:
            body = {"model": folder.name, "prompt": job[0], "max_tokens": job[1], "ignore_eos": True}
            response = httpx.post(served.url + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return int(response.json()["usage"]["completion_tokens"])

        with ThreadPoolExecutor(len(jobs)) as pool:
            completions = list(pool.map(ask, jobs))
        assert completions == [n for _, n in jobs]
        text = served.get("/metrics").text
        assert metric_value(text, "nanoverify:prompt_tokens_total") == sum(len(p) for p, _ in jobs)
        assert metric_value(text, "nanoverify:generation_tokens_total") == sum(completions)
        assert metric_value(text, 'nanoverify:request_success_total{finished_reason="length"}') == len(jobs)
        assert metric_value(text, "nanoverify:e2e_request_latency_seconds_count") == len(jobs)
        assert metric_value(text, "nanoverify:num_requests_running") == 0
        state = served.get("/health", params={"verbose": "1"}).json()["engine"]
        assert state["running"] == state["waiting"] == 0 and state["violations"] == []
        assert state["free_blocks"] == state["num_blocks"] == 64
        assert metric_value(text, "nanoverify:kv_cache_usage_perc") == 0
    finally:
        status = stop(served)
    assert status == 0


@pytest.mark.clause("SERVE-2", "CLI-1")
def test_a_model_the_engine_process_refuses_is_one_line_and_status_2(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """SERVE-2, CLI-1: the engine process builds the LLM; a checkpoint it refuses is the loader's own one-line
    error from ``nanoverify serve`` (the ValueError crosses the pipe whole), status 2, and the engine process is
    gone when the command returns."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt-neo"}))
    assert cli_main(["serve", "--model", str(tmp_path), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("nanoverify serve: config.json: model_type must be one of"), err
    assert [p for p in multiprocessing.active_children() if p.name == "nanoverify-engine"] == []


@pytest.mark.clause("SERVE-7", "SERVE-8")
def test_a_hang_up_is_forgotten_at_once_so_a_drain_does_not_wait_for_it(serve_cache: Path) -> None:
    """SERVE-7: a client that hangs up mid-stream has its request aborted, and is no longer in flight; SERVE-8: so
    a SIGTERM after it finds nothing to wait for and the server exits at once, not at the end of the grace
    period."""
    folder = with_config("qwen3", "engine-process", max_position_embeddings=8192)
    served = spawn(["--model", str(folder), "--shutdown-timeout", "60"], serve_cache / "hang-up-drain.log")
    aborted = 'nanoverify:request_success_total{finished_reason="abort"}'
    try:
        body = {"model": folder.name, "prompt": [1, 2, 3], "max_tokens": 8000, "ignore_eos": True, "stream": True,
                "return_token_ids": True}
        with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as response:
            for count, _ in enumerate(response.iter_lines()):
                if count == 6:
                    break  # hang up mid-answer
        deadline = time.monotonic() + 30
        while metric_value(served.get("/metrics").text, aborted) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric_value(served.get("/metrics").text, aborted) == 1  # aborted, not run to its end
        sent = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(60) == 0
        assert time.monotonic() - sent < 15, "the drain waited for a request whose client had gone"
        assert "still running" not in served.log.read_text()
    finally:
        kill(served)


@pytest.mark.clause("SERVE-9", "TRACE-4")
def test_a_request_the_trace_cannot_record_is_a_400_before_its_stream_starts(serve_cache: Path) -> None:
    """SERVE-9, TRACE-4: with --trace, a prompt whose add record would pass the trace reader's line limit is
    refused like any other limit, a 400 naming it, also when streamed (never a 200 whose stream then fails)."""
    folder = with_config("qwen3", "long-trace", max_position_embeddings=500_000)
    trace = serve_cache / "long.trace.jsonl"
    served = spawn(["--model", str(folder), "--trace", str(trace), "--num-kvcache-blocks", "30000"],
                   serve_cache / "long-trace.log")
    try:
        ids = ",".join(["1"] * 400_000)  # 800 KB of body: under its 1 MiB limit; as the trace writes it, past it
        for stream in ("true", "false"):
            raw = f'{{"model": "{folder.name}", "prompt": [{ids}], "max_tokens": 1, "stream": {stream}}}'
            response = httpx.post(served.url + "/v1/completions", content=raw, timeout=120,
                                  headers={"content-type": "application/json"})
            assert response.status_code == 400, response.text[:300]
            error = response.json()["error"]
            assert error["param"] == "prompt" and error["message"].startswith(
                "prompt: is too long for the trace: the trace's add record")
            assert "line limit" in error["message"]
        ok = httpx.post(served.url + "/v1/completions", timeout=60,
                        json={"model": folder.name, "prompt": [1, 2], "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        status = stop(served)
    assert status == 0


class Recording:
    """The HTTP side's end of the pipe, keeping every command sent through it; ``unreadable``: the message
    received that many messages in raises as one that cannot be unpickled would (after it was read whole)."""

    def __init__(self, engine: EngineProcess, unreadable: int = 0) -> None:
        self.conn = engine._conn
        self.commands: list[Any] = []
        self.unreadable = unreadable
        self.received = 0
        engine._conn = self  # type: ignore[assignment]

    def send(self, command: Any) -> None:
        self.commands.append(command)
        self.conn.send(command)

    def recv(self) -> Any:
        message = self.conn.recv()
        self.received += 1
        if self.received == self.unreadable:
            raise pickle.UnpicklingError("injected by the test")
        return message

    def close(self) -> None:
        self.conn.close()


def _engine(folder: Path) -> EngineProcess:
    return EngineProcess({"model": str(folder), "num_kvcache_blocks": 16}, Metrics())


def last_event(engine: EngineProcess, meanwhile: Callable[[], None] = lambda: None) -> Any:
    """Submit a 250-token request, call ``meanwhile`` once its first event is in; its last event."""

    async def ask() -> Any:
        stream = Stream([1, 2, 3], SamplingParams(max_tokens=250, ignore_eos=True), asyncio.get_running_loop())
        engine.submit(stream)
        event = await asyncio.wait_for(stream.queue.get(), 30)
        meanwhile()
        while isinstance(event, TokenEvent):
            event = await asyncio.wait_for(stream.queue.get(), 30)
        return event

    return asyncio.run(ask())


def assert_aborted_drained_and_stopped(engine: EngineProcess, sent: Recording) -> None:
    """The engine was told to abort, the reader still drains the pipe, and a stop ends the engine at once."""
    deadline = time.monotonic() + 10
    while AbortAll() not in sent.commands and time.monotonic() < deadline:
        time.sleep(0.02)
    assert AbortAll() in sent.commands  # nobody waits for what the engine runs any more
    time.sleep(1)
    assert engine._reader.is_alive()  # still draining the pipe
    started = time.monotonic()
    engine.stop()
    assert time.monotonic() - started < 20 and engine.process.exitcode == 0


@pytest.mark.clause("SERVE-12")
def test_a_message_the_server_cannot_take_ends_trust_but_not_the_shutdown(monkeypatch: pytest.MonkeyPatch) -> None:
    """SERVE-12: if the server's reader cannot take a message from the engine process (a defect of ours), the
    request in flight fails with a 500 that says so, nothing more is admitted, the engine is told to abort, and
    stopping still ends the engine process at once (the reader keeps draining the pipe)."""
    folder = with_config("qwen3", "engine-process", max_position_embeddings=8192)

    def broken(self: Metrics, update: MetricUpdate) -> None:
        raise RuntimeError("injected by the test")

    monkeypatch.setattr(Metrics, "apply", broken)
    engine = _engine(folder)
    sent = Recording(engine)
    try:
        engine.start()
        event = last_event(engine)
        assert isinstance(event, FailEvent) and event.status == 500 and "injected by the test" in event.message
        assert engine.failure is not None and engine.in_flight() == 0
        with pytest.raises(Unavailable):
            engine.submit(Stream([1], SamplingParams()))
        assert_aborted_drained_and_stopped(engine, sent)
    finally:
        engine.stop(timeout=5)


@pytest.mark.clause("SERVE-20")
def test_an_engine_process_killed_for_not_stopping_is_a_loss() -> None:
    """SERVE-20: an engine process that does not stop within its time (stopped with SIGSTOP, told to stop with 1 s
    to do it) is killed: that is a loss (``failure`` says so), the stream in
    flight ends with the shutdown's 503, and the gauges that read 1 running and blocks in use drop to 0."""
    folder = with_config("qwen3", "engine-process", max_position_embeddings=8192)
    engine = _engine(folder)
    pid = engine.process.pid
    assert pid is not None
    gauges: list[float] = []

    def frozen_then_stopped() -> None:
        deadline = time.monotonic() + 10  # the first step's gauges may come just after its tokens
        while not engine.metrics.registry.get_sample_value("nanoverify:num_requests_running") and (
                time.monotonic() < deadline):
            time.sleep(0.005)
        gauges.extend(engine.metrics.registry.get_sample_value("nanoverify:" + name) or 0.0
                      for name in ("num_requests_running", "kv_cache_usage_perc"))
        os.kill(pid, signal.SIGSTOP)
        engine.stop(timeout=1)

    try:
        engine.start()
        event = last_event(engine, frozen_then_stopped)
        assert isinstance(event, FailEvent) and event.status == 503, event
        assert engine.failure == "the engine process did not stop within 1 s"
        assert gauges[0] == 1 and gauges[1] > 0, gauges
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert engine.metrics.registry.get_sample_value("nanoverify:" + name) == 0, name
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGCONT)
        engine.stop(timeout=5)


@pytest.mark.clause("SERVE-12")
def test_a_message_the_server_cannot_even_unpickle_ends_trust_too() -> None:
    """SERVE-12: a message from the engine process that is read whole but cannot be unpickled ends trust as one
    that cannot be taken: the stream in flight fails with a 500, the engine is told to abort, the reader goes on
    draining, and stopping ends the engine process at once."""
    folder = with_config("qwen3", "engine-process", max_position_embeddings=8192)
    engine = _engine(folder)
    sent = Recording(engine, unreadable=3)
    try:
        engine.start()
        event = last_event(engine)
        assert isinstance(event, FailEvent) and event.status == 500 and "UnpicklingError" in event.message
        assert_aborted_drained_and_stopped(engine, sent)
    finally:
        engine.stop(timeout=5)


@pytest.mark.clause("SERVE-12")
def test_a_command_the_server_cannot_send_ends_trust_but_not_the_shutdown() -> None:
    """SERVE-12: a command that cannot cross the pipe (a defect of ours: here one that does not pickle) ends
    trust: the stream in flight fails with a 500 that says so, the engine is told to abort, a submit queued
    behind the bad command is dropped, and the stop after them still reaches the engine process."""
    folder = with_config("qwen3", "engine-process", max_position_embeddings=8192)
    engine = _engine(folder)
    sent = Recording(engine)
    try:
        engine.start()

        def unsendable_then_a_submit() -> None:  # while the request runs
            engine._outbox.put(ReadState(lambda: None))  # type: ignore[arg-type]
            engine._outbox.put(Submit(99, [1], SamplingParams()))

        event = last_event(engine, unsendable_then_a_submit)
        assert isinstance(event, FailEvent) and event.status == 500 and "could not send ReadState" in event.message
        assert not [c for c in sent.commands if isinstance(c, Submit) and c.key == 99]
        assert_aborted_drained_and_stopped(engine, sent)
    finally:
        engine.stop(timeout=5)


@pytest.mark.clause("SERVE-12", "SERVE-8")
def test_a_command_the_engine_process_does_not_know_fails_what_is_in_flight_with_a_500() -> None:
    """SERVE-12, SERVE-8: a command the engine process cannot carry out (a defect of ours: here the old
    string-tagged tuple) ends trust: the request in flight fails with a 500 naming the command's type, never a
    clean finish_reason "abort" (which SERVE-8 keeps for shutdown), even though the engine process's stop then
    aborts it; nothing more is admitted and stopping still ends at once."""
    folder = with_config("qwen3", "engine-process", max_position_embeddings=8192)
    engine = _engine(folder)
    try:
        engine.start()
        event = last_event(engine, lambda: engine._outbox.put(("cancel", 1)))  # type: ignore[arg-type]
        assert isinstance(event, FailEvent), event
        assert event.status == 500 and "tuple" in event.message and "no longer trusted" in event.message
        assert engine.failure is not None and "tuple" in engine.failure
        with pytest.raises(Unavailable):
            engine.submit(Stream([1], SamplingParams()))
        started = time.monotonic()
        engine.stop()
        assert time.monotonic() - started < 20 and not engine.process.is_alive()
    finally:
        engine.stop(timeout=5)


@pytest.mark.clause("SERVE-2", "TP-2")
def test_served_under_torchrun_as_in_one_process_and_ctrl_c_leaves_nothing(serve_cache: Path) -> None:
    """SERVE-2, TP-2: ``torchrun --nproc-per-node 2 -m optimized.cli serve --tensor-parallel-size 2``: the engine
    process of rank 0 joins torchrun's group (rank 1 serves it), a greedy float64 completion is token for token
    what one process computes, and Ctrl-C to the job ends every process of it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    serve = ["-m", "optimized.cli", "serve", "--tensor-parallel-size", "2", "--port", "0", "--dtype", "float64",
             "--num-kvcache-blocks", "64"]
    with (serve_cache / "torchrun.log").open("w") as log:
        job = subprocess.Popen([*torchrun, *serve], stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                               start_new_session=True)
    try:
        url = None
        assert job.stdout is not None
        for line in job.stdout:
            if "listening on" in line:
                url = line.split("listening on ")[1].strip()
                break
        assert url is not None, (serve_cache / "torchrun.log").read_text()[-2000:]
        body = {"model": "default", "prompt": "hello world", "max_tokens": 10, "temperature": 0,
                "return_token_ids": True}
        served = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["token_ids"]
        llm = LLM(None, dtype="float64", num_kvcache_blocks=64)
        offline = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
        assert served == offline[0].token_ids
        os.killpg(job.pid, signal.SIGINT)
        job.wait(60)
        deadline = time.monotonic() + 30
        while group_alive(job.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not group_alive(job.pid), "a process of the torchrun job outlived Ctrl-C"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()


def group_alive(group: int) -> bool:
    """Whether a live (not zombie) process is left in process group ``group``."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == group and fields[0] != "Z":
                return True
    return False


def pipe_messages() -> list[Any]:
    """One message of every type that crosses the engine pipe, down then up, with every field set."""
    params = SamplingParams(temperature=0.5, max_tokens=3, top_k=0, seed=7, stop_token_ids=(2,), stop=("x",))
    output = RequestOutput(4, None, [1, 2], [3], "c", "stop")
    return [
        Submit(1, [1, 2], params), Cancel(1), ReadState(2), AbortAll(), Stop(),
        Ready(EngineInfo(EngineLimits(256, 4096, 128, 16, (0,)), Path("/m"), True)),
        Events([(1, TokenEvent([3], 1.5, 1.25)), (1, FinishEvent(output, 2.0)),
                (2, FailEvent(500, "why"))]),
        StateAnswer(2, EngineState(128, 120, 3, 1, 2, ["a violation"], 9)), StateAnswer(3, None, "stopped"),
        Failed("why"), Admitted(5), Generated(6), Finished("length"), Diverged(),
        Lost(), AfterStep(EngineStats(steps=3, preemptions=2), Gauges(1, 2, 96, 128)),
    ]


@pytest.mark.clause("ARCH-7", "SERVE-2")
def test_every_pipe_message_is_a_frozen_dataclass_that_crosses_a_real_pipe_whole() -> None:
    """ARCH-7: every message between the server and its engine process is a frozen dataclass, no string-tagged
    tuple, and crosses a real pipe (pickled, as between the two processes) equal to what was sent and of its
    type; a refusal that stops the engine's start keeps its field and code."""
    import dataclasses

    sending, receiving = multiprocessing.Pipe()
    try:
        for message in pipe_messages():
            assert dataclasses.is_dataclass(message) and not isinstance(message, tuple)
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(message, "key", 0)  # noqa: B010 (any field, or a new one)
            sending.send(message)
            got = receiving.recv()
            assert type(got) is type(message) and got == message
        sending.send(NotBuilt(RequestRefused("prompt", "is too long", "context_length_exceeded", "in words")))
        refusal = receiving.recv().error
        assert isinstance(refusal, RequestRefused)
        assert (str(refusal), refusal.field, refusal.reason, refusal.code) == (
            "in words", "prompt", "is too long", "context_length_exceeded")
    finally:
        sending.close()
        receiving.close()


@pytest.mark.clause("ARCH-7", "SERVE-13")
def test_metrics_updates_are_dispatched_by_type_and_a_tagged_tuple_is_refused() -> None:
    """ARCH-7, SERVE-13: ``Metrics.apply`` replays each typed update into its series; the old string-tagged
    tuple, or anything of no known type, is a TypeError (a defect the pipe's reader turns into lost trust),
    and so is a message the server's reader does not take."""
    metrics = Metrics()
    for update in pipe_messages():
        if isinstance(update, MetricUpdate):
            metrics.apply(update)
    value = metrics.registry.get_sample_value
    assert value("nanoverify:prompt_tokens_total") == 5 and value("nanoverify:generation_tokens_total") == 6
    assert value("nanoverify:request_success_total", {"finished_reason": "length"}) == 1
    assert value("nanoverify:check_divergences_total") == 1 and value("nanoverify:num_preemptions_total") == 2
    assert value("nanoverify:num_requests_running") == 1 and value("nanoverify:num_requests_waiting") == 2
    assert value("nanoverify:kv_cache_usage_perc") == 0.25
    with pytest.raises(TypeError):
        metrics.apply(("admitted", (5,)))  # type: ignore[arg-type]
    reader = EngineProcess.__new__(EngineProcess)  # its taking half only: no process to start
    with pytest.raises(TypeError):
        reader._take(("failed", "why"))  # type: ignore[arg-type]
