"""The server's lifecycle: shutdown on SIGTERM (spawned), a check-mode divergence and hang-ups (in process).

The in-process tests run the app under uvicorn in a thread, on a tiny checkpoint (token-id prompts), so they can
reach into the engine: make the shadow diverge, time an abort against the steps.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest
import uvicorn

from optimized import LLM, SamplingParams
from optimized.cli import main as cli_main
from optimized.engine.validation import RequestRefused
from optimized.entry.llm import EngineState
from optimized.serve.app import Lifecycle, ServerOptions, build_app
from optimized.serve.chat import DEFAULT_TEMPLATE, ChatTemplate
from optimized.serve.loop import EngineInfo, EngineLoop, FinishEvent, Stream, TokenEvent
from optimized.serve.metrics import Metrics
from tests.engine_fixtures import make_llm, with_config
from tests.test_serve import spawn, stop

pytestmark = pytest.mark.usefixtures("engine_env")


def stream_lines(client: httpx.Client, url: str, payload: dict[str, Any], seen: threading.Event,
                 out: list[str]) -> None:
    """POST a streamed completion, keep its SSE data lines; ``seen`` is set at the first content line."""
    with client.stream("POST", url, json=payload, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:])
                seen.set()


@pytest.mark.clause("SERVE-8")
def test_sigterm_drains_then_aborts_and_exits_zero(serve_cache: Path) -> None:
    """SERVE-8: on SIGTERM the server admits nothing more (503) while in-flight streams go on; a short one
    finishes normally, the long ones are aborted at the deadline and end cleanly (finish_reason "abort", then
    [DONE]); the process exits 0 within the grace period (plus the settle time). A tiny checkpoint with a long
    context: the long requests cannot finish within the grace period, the short one (in flight when the signal
    comes) can."""
    folder = with_config("qwen3", "long-context", max_position_embeddings=8192)
    served = spawn(["--model", str(folder), "--shutdown-timeout", "3", "--max-num-seqs", "4"],
                   serve_cache / "sigterm.log")
    name = folder.name
    try:
        url = served.url + "/v1/completions"
        long = {"model": name, "prompt": [1, 2], "max_tokens": 8000, "ignore_eos": True, "stream": True,
                "return_token_ids": True}
        short = {**long, "max_tokens": 200}
        outs: list[list[str]] = [[], [], []]
        seen = [threading.Event() for _ in outs]
        with httpx.Client() as client:
            threads = [threading.Thread(target=stream_lines, args=(client, url, p, seen[i], outs[i]))
                       for i, p in enumerate((long, long, short))]
            for t in threads:
                t.start()
            assert all(s.wait(60) for s in seen)
            sent = time.monotonic()
            served.proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            assert httpx.get(served.url + "/health").status_code == 503
            refused = httpx.post(url, json={"model": name, "prompt": [3], "max_tokens": 2})
            assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
            for t in threads:
                t.join(30)
        assert served.proc.wait(15) == 0
        assert time.monotonic() - sent < 3 + 2 + 3
        for out, reason in zip(outs, ("abort", "abort", "length"), strict=True):
            assert out[-1] == "[DONE]"
            assert json.loads(out[-2])["choices"][0]["finish_reason"] == reason, out[-3:]
        tokens = [sum(len(json.loads(line)["choices"][0].get("token_ids", [])) for line in out[:-1]) for out in outs]
        assert tokens[2] == 200 and 0 < tokens[0] < 8000 and 0 < tokens[1] < 8000
    finally:
        stop(served)


class InProcess:
    """The app over ``llm`` under uvicorn in a thread (no signal handling there), on a free port."""

    def __init__(self, llm: LLM, options: ServerOptions | None = None) -> None:
        self.metrics = Metrics()
        self.loop = EngineLoop(llm, self.metrics)
        self.life = Lifecycle()
        app = build_app(EngineInfo.of(llm), self.loop, self.metrics, ChatTemplate(DEFAULT_TEMPLATE),
                        options or ServerOptions(), self.life)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        assert not self.thread.is_alive(), "the in-process server did not stop"


@pytest.mark.clause("SERVE-12", "SERVE-20")
def test_a_divergence_fails_requests_and_turns_health_503(caplog: pytest.LogCaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """SERVE-12: when check mode's shadow raises ShadowDivergence, the requests in flight fail with a 500 that
    says so (streamed: an error event), /health turns 503, nothing more is admitted, and the log holds both
    schedulers' states."""
    llm = make_llm(num_kvcache_blocks=64)
    assert llm.shadow is not None
    real = llm.shadow.after_postprocess
    calls = [0]

    def diverge_at_step_five(*args: Any) -> None:
        calls[0] += 1
        if calls[0] == 5:
            llm.shadow._fail(llm.engine.scheduler, "injected by the test")  # type: ignore[union-attr]
        real(*args)

    monkeypatch.setattr(llm.shadow, "after_postprocess", diverge_at_step_five)
    server = InProcess(llm)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        assert httpx.get(server.url + "/health").status_code == 200
        results: list[BaseException] = []

        def whole() -> None:
            try:
                client.completions.create(model="default", prompt=[1, 2, 3], max_tokens=40, temperature=0)
            except openai.APIError as e:
                results.append(e)

        waiting = threading.Thread(target=whole)
        with caplog.at_level(logging.ERROR, logger="nanoverify.serve"):
            waiting.start()
            with pytest.raises(openai.APIError, match="no longer trusted"):
                for _ in client.completions.create(model="default", prompt=[4, 5], max_tokens=40, stream=True):
                    pass
            waiting.join(30)
        assert isinstance(results[0], openai.InternalServerError) and "diverging" in str(results[0])
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "check mode" in health.json()["status"]
        late = httpx.post(server.url + "/v1/completions", json={"model": "default", "prompt": [1], "max_tokens": 2})
        assert late.status_code == 503 and "no longer trusted" in late.json()["error"]["message"]
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert "--- engine scheduler ---" in logged and "--- reference scheduler ---" in logged
        assert "injected by the test" in logged
        assert "nanoverify:check_divergences_total 1.0" in server.metrics.text().decode()
        for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):  # SERVE-20
            assert server.metrics.registry.get_sample_value("nanoverify:" + gauge) == 0, gauge
    finally:
        server.close()


@pytest.mark.clause("SERVE-7", "SERVE-2")
def test_a_cancelled_request_is_aborted_before_the_next_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """SERVE-7: the loop aborts a cancelled request before it runs another step (the one in progress may
    finish), its blocks are free again and its stream is told nothing more; SERVE-2: requests submitted while
    the loop steps join the running batch between steps."""
    llm = make_llm(num_kvcache_blocks=64)
    loop = EngineLoop(llm, Metrics())
    steps_at_abort: list[int] = []
    real_abort = llm.abort

    def abort(request_id: int) -> Any:
        steps_at_abort.append(llm.engine.stats.steps)
        return real_abort(request_id)

    monkeypatch.setattr(llm, "abort", abort)
    loop.start()

    async def scenario() -> tuple[int, Stream, Stream]:
        here = asyncio.get_running_loop()
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        first = Stream([1, 2, 3], params, here)
        loop.submit(first)
        await first.queue.get()
        second = Stream([7, 8], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), here)
        loop.submit(second)  # arrives while the first is decoding
        while not isinstance(await second.queue.get(), FinishEvent):
            pass
        steps = llm.engine.stats.steps
        loop.cancel(first)
        return steps, first, second

    try:
        steps_at_cancel, first, _ = asyncio.run(scenario())
        deadline = time.monotonic() + 10
        while not steps_at_abort and time.monotonic() < deadline:
            time.sleep(0.01)
        assert steps_at_abort and steps_at_abort[0] <= steps_at_cancel + 1
        assert llm.completion_tokens(first.request_id or 0) is None  # no longer live
        free = loop.call_between_steps(lambda: len(llm.engine.scheduler.block_manager.free_block_ids)).result(10)
        assert free == 64
    finally:
        loop.stop()


@pytest.mark.clause("SERVE-11")
def test_serve_flags_are_checked_before_anything_loads(capsys: pytest.CaptureFixture[str]) -> None:
    """SERVE-11, CLI-2: a bad port, a blank or non-ASCII key, a negative grace, an engine option out of range is one
    line and status 2, nothing loaded."""
    for argv, words in ((["--port", "70000"], "--port"), (["--api-key", "  "], "--api-key"),
                        (["--shutdown-timeout", "-1"], "--shutdown-timeout"), (["--api-key", "k\u00e9y"], "ASCII"),
                        (["--gpu-memory-utilization", "1.5"], "(0, 1]"), (["--cpu-kvcache-gib", "0"], "> 0"),
                        (["--attention-backend", "nope"], "--attention-backend")):
        assert cli_main(["serve", *argv]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err


@pytest.mark.clause("SERVE-12")
def test_a_model_fault_fails_only_its_batch_and_the_server_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """SERVE-12, FAULT-1: a step whose model run raises fails its batch's requests with a 500; the engine stays
    trusted, /health stays 200 and the next request is served."""
    llm = make_llm(num_kvcache_blocks=64)
    real = llm.engine.runner.run
    calls = [0]

    def fail_the_third_run(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected model fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "run", fail_the_third_run)
    server = InProcess(llm)
    try:
        ask = {"model": "default", "prompt": [1, 2, 3], "max_tokens": 10, "temperature": 0}
        failed = httpx.post(server.url + "/v1/completions", json=ask, timeout=30)
        assert failed.status_code == 500 and "model failed" in failed.json()["error"]["message"]
        assert httpx.get(server.url + "/health").status_code == 200
        served = httpx.post(server.url + "/v1/completions", json=ask, timeout=30)
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 10
    finally:
        server.close()


@pytest.mark.clause("SERVE-8")
def test_a_second_signal_aborts_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """SERVE-8: the first signal starts the drain (admission closed); a second one aborts what is left and
    tells uvicorn to exit without waiting for the grace period."""
    from optimized.serve.server import NanoverifyServer

    loop = EngineLoop(make_llm(num_kvcache_blocks=16), Metrics())
    aborted: list[bool] = []
    running = [1]  # a request that would run for ever, until the test ends
    monkeypatch.setattr(loop, "in_flight", lambda: running[0])
    monkeypatch.setattr(loop, "abort_all", lambda: aborted.append(True))
    life = Lifecycle()
    server = NanoverifyServer(uvicorn.Config(lambda *a: None), loop, life, shutdown_timeout=60)
    server.handle_exit(signal.SIGTERM, None)
    try:
        assert life.draining and not server.should_exit and not aborted
        with pytest.raises(Exception, match="shutting down"):
            loop.submit(Stream([1], SamplingParams(), asyncio.new_event_loop()))
        server.handle_exit(signal.SIGINT, None)
        assert aborted and server.should_exit
    finally:
        running[0] = 0  # the drain thread ends now, not after the 60 s grace period
        assert server.drainer is not None
        server.drainer.join(5)
        assert not server.drainer.is_alive()


@pytest.mark.clause("SERVE-14")
def test_the_bench_client_measures_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """SERVE-14: bench serve's HTTP client against a live server: every request completes with exactly its
    length, one timed chunk per step (token ids asked for), and the report counts them all."""
    from optimized.benchmarks import serve as bench

    server = InProcess(make_llm(num_kvcache_blocks=64, check=False))
    try:
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        jobs = bench.random_jobs(6, 8, 12, 256, 50.0, 1.0, seed=1)
        results, duration = asyncio.run(bench.run_clients(host, int(port), "default", jobs))
    finally:
        server.close()
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.tokens for r in results] == [j.output_len for j in jobs]
    assert all(len(r.chunk_times) >= 1 and r.ttft > 0 for r in results)
    assert bench.report(jobs, results, duration) == pytest.approx(sum(j.output_len for j in jobs) / duration)


@pytest.mark.clause("SERVE-14")
def test_bench_workloads_arrivals_and_percentiles(tmp_path: Path) -> None:
    """SERVE-14: gamma arrivals at the asked rate (inf: all at once), the shipped trace scaled as documented, a bad
    trace file refused naming its line, percentiles interpolated as numpy's."""
    import random as _random

    from optimized.benchmarks import serve as bench

    assert bench.gamma_arrivals(5, float("inf"), 1.0, _random.Random(0)) == [0.0] * 5
    times = bench.gamma_arrivals(4000, 20.0, 1.0, _random.Random(0))
    assert times == sorted(times) and 4000 / times[-1] == pytest.approx(20.0, rel=0.1)
    jobs = bench.trace_jobs(bench.trace_rows(bench.AZURE_CODE, 3), 257, 4096, 16.0, 2.0, None, seed=0)
    # The trace's first rows: (0.0, 4808, 10), (0.052, 3180, 8), (0.098189, 110, 27).
    assert [(j.arrival, len(j.prompt), j.output_len) for j in jobs] == [
        (0.0, 300, 5), (0.052, 199, 4), (0.098189, 7, 14)]
    for text, message in (("arrived_at,num_prefill_tokens\n0,1\n", "line 2: no column 'num_decode_tokens'"),
                          ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,x,1\n", "line 2: not a number"),
                          ("arrived_at,num_prefill_tokens,num_decode_tokens\nnan,1,1\n", "line 2: a time must be"),
                          ("arrived_at,num_prefill_tokens,num_decode_tokens\n", "no requests"),
                          ("arrived_at,num_prefill_tokens,num_decode_tokens\n1,1,1\n0.5,1,1\n", "line 3: arrived_at"),
                          ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,\"" + "x" * 200_000 + "\"\n",
                           "line 2: field larger than field limit"),
                          ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,\xff\n", "not UTF-8 text")):
        bad = tmp_path / "bad.csv"
        bad.write_bytes(text.encode("latin-1"))  # "\xff": a byte that is not UTF-8
        with pytest.raises(ValueError, match=message):
            bench.trace_rows(bad, 3)
    stats = bench.percentiles([1.0, 2.0, 3.0, 4.0])
    assert stats == {"mean": 2.5, "p50": 2.5, "p90": pytest.approx(3.7), "p99": pytest.approx(3.97)}


@pytest.mark.clause("SERVE-2", "SERVE-8")
def test_an_idle_loop_sleeps_even_after_aborting_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """SERVE-2: with nothing to do the loop sleeps on its condition; SERVE-8: the shutdown's abort of everything
    is done once, not again and again (a loop spinning through the grace period would steal the CPU)."""
    loop = EngineLoop(make_llm(num_kvcache_blocks=16), Metrics())
    turns = [0]
    real = loop._turn

    def counted() -> bool:
        turns[0] += 1
        return real()

    monkeypatch.setattr(loop, "_turn", counted)
    loop.start()
    try:
        time.sleep(0.1)
        loop.abort_all()
        time.sleep(0.3)
        assert turns[0] <= 3, f"{turns[0]} turns of an idle loop"
    finally:
        loop.stop()


@pytest.mark.clause("SERVE-11", "SERVE-1", "SERVE-22")
def test_the_key_comes_from_the_flag_or_the_environment() -> None:
    """SERVE-11: --api-key wins over NANOVERIFY_API_KEY; an empty variable means no key; a blank one is refused.
    SERVE-1: the served name is "default" for the embedded model, else the checkpoint folder's name."""
    from optimized.cli.serve import api_key, served_names

    assert api_key("flag", {"NANOVERIFY_API_KEY": "env"}) == "flag"
    assert api_key(None, {"NANOVERIFY_API_KEY": "env"}) == "env"
    assert api_key(None, {"NANOVERIFY_API_KEY": ""}) is None and api_key(None, {}) is None
    with pytest.raises(ValueError, match="blank"):
        api_key(None, {"NANOVERIFY_API_KEY": "  "})
    # A key a client could not send as it is: surrounding whitespace (stripped from headers), non-ASCII.
    for bad, source in ((" sk-1", "--api-key"), ("sk-\u00e9", "--api-key"), ("sk\n", "NANOVERIFY_API_KEY")):
        flag, env = (bad, {}) if source == "--api-key" else (None, {"NANOVERIFY_API_KEY": bad})
        with pytest.raises(ValueError, match=source):
            api_key(flag, env)
    assert served_names(None) == ("default",)
    assert served_names("/models/qwen3-0.6b/") == ("/models/qwen3-0.6b/", "qwen3-0.6b")  # SERVE-22
    assert served_names("/models/qwen3-0.6b/", ["a", "b", "a"]) == ("a", "b")


@pytest.mark.clause("SERVE-7")
def test_a_client_that_stops_waiting_for_a_whole_answer_cancels_it() -> None:
    """SERVE-7: a non-streamed request whose client gives up (a timeout closes the connection) is aborted; its
    blocks are free again."""
    llm = make_llm(with_config("qwen3", "long-context", max_position_embeddings=8192), num_kvcache_blocks=2100,
                   check=False)
    server = InProcess(llm)
    try:
        ask = {"model": "default", "prompt": [1, 2, 3], "max_tokens": 8000, "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/completions", json=ask, timeout=0.5)
        deadline = time.monotonic() + 10
        while llm.engine.stats.aborted_requests == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert llm.engine.stats.aborted_requests == 1
        free = server.loop.call_between_steps(lambda: len(llm.engine.scheduler.block_manager.free_block_ids))
        assert free.result(10) == 2100
    finally:
        server.close()


@pytest.mark.clause("SERVE-4")
def test_stream_interval_groups_tokens_into_fewer_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """SERVE-4: with --stream-interval 3 the first token comes at once, then a chunk once 3 tokens wait, and the
    last chunk brings the rest: the same tokens in fewer chunks. The second step waits until the client has the
    first chunk (else a slow HTTP side would rightly put two steps' tokens in it)."""
    llm = make_llm(num_kvcache_blocks=64, check=False)
    seen = threading.Event()
    real = llm.engine.runner.run
    calls = [0]

    def second_run_waits_for_the_first_chunk(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            seen.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "run", second_run_waits_for_the_first_chunk)
    server = InProcess(llm, ServerOptions(stream_interval=3))
    try:
        ask = {"model": "default", "prompt": [5, 6], "max_tokens": 11, "ignore_eos": True, "temperature": 0,
               "stream": True, "return_token_ids": True}
        out: list[str] = []
        with httpx.Client() as client:
            stream_lines(client, server.url + "/v1/completions", ask, seen, out)
        sizes = [len(json.loads(line)["choices"][0].get("token_ids", [])) for line in out[:-1]]
        assert sum(sizes) == 11 and sizes[0] == 1 and all(n >= 3 for n in sizes[1:-1]) and len(sizes) <= 5, sizes
    finally:
        server.close()


@pytest.mark.clause("SERVE-11")
def test_a_port_in_use_is_one_line_and_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    """SERVE-11, CLI-1: a port another socket holds is refused as one line naming it, status 2 (not uvicorn's
    own exit status)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        tiny = str(with_config("qwen3", "long-context", max_position_embeddings=8192))
        assert cli_main(["serve", "--model", tiny, "--port", str(port), "--num-kvcache-blocks", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("nanoverify serve: could not listen on 127.0.0.1:") and str(port) in err, err


async def _last_event(stream: Stream) -> Any:
    """The stream's FinishEvent or FailEvent (its TokenEvents skipped)."""
    while True:
        event = await asyncio.wait_for(stream.queue.get(), 30)
        if not isinstance(event, TokenEvent):
            return event


@pytest.mark.clause("SERVE-12", "SERVE-7")
def test_a_hang_up_during_a_failed_step_leaves_the_loop_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """SERVE-12, SERVE-7: a model fault (FAULT-1) whose request's client hangs up while the step fails: the failed
    output, which comes from the next step, goes to the cancelled stream (nobody listens); the loop goes on and
    serves the next request."""
    llm = make_llm(num_kvcache_blocks=64, check=False)
    loop = EngineLoop(llm, Metrics())
    real = llm.engine.runner.run
    calls = [0]
    victim: list[Stream] = []

    def fail_the_third_run(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            loop.cancel(victim[0])  # the client hangs up while the faulty step runs
            raise RuntimeError("injected model fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "run", fail_the_third_run)

    async def scenario() -> Any:
        here = asyncio.get_running_loop()
        victim.append(Stream([1, 2, 3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), here))
        loop.submit(victim[0])
        while calls[0] < 3:
            await asyncio.sleep(0.01)
        after = Stream([4, 5], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), here)
        loop.submit(after)
        return await _last_event(after)

    loop.start()
    try:
        last = asyncio.run(scenario())
        assert isinstance(last, FinishEvent) and last.output.finish_reason == "length", last
        assert loop.failure is None and loop.thread.is_alive()
    finally:
        loop.stop()


@pytest.mark.clause("SERVE-13")
def test_gauges_follow_a_turn_that_only_aborts() -> None:
    """SERVE-13: a hang-up that leaves nothing to step still updates the gauges: running 0, KV cache usage 0."""
    llm = make_llm(num_kvcache_blocks=64, check=False)
    metrics = Metrics()
    loop = EngineLoop(llm, metrics)

    async def scenario() -> None:
        stream = Stream([1, 2, 3], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                        asyncio.get_running_loop())
        loop.submit(stream)
        await stream.queue.get()
        await asyncio.wrap_future(loop.call_between_steps(lambda: None))  # its step is over: the gauges say so
        assert metrics.registry.get_sample_value("nanoverify:num_requests_running") == 1
        loop.cancel(stream)

    loop.start()
    try:
        asyncio.run(scenario())
        deadline = time.monotonic() + 10
        while llm.engine.stats.aborted_requests == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        loop.call_between_steps(lambda: None).result(10)  # the turn that aborted it is over
        assert metrics.registry.get_sample_value("nanoverify:num_requests_running") == 0
        assert metrics.registry.get_sample_value("nanoverify:kv_cache_usage_perc") == 0
    finally:
        loop.stop()


@pytest.mark.clause("SERVE-12")
def test_a_probe_after_the_loop_stopped_is_refused_not_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """SERVE-12: a probe (/health?verbose=1) asked for once the loop is stopping is refused at once, never left
    waiting for a turn that will not come."""
    from optimized.serve.loop import Unavailable

    loop = EngineLoop(make_llm(num_kvcache_blocks=16, check=False), Metrics())
    real = loop._turn
    late: list[Any] = []

    def turn_then_a_late_probe() -> bool:
        going = real()
        if not going:  # the loop is about to end: a handler asks now
            late.append(loop.call_between_steps(lambda: "answered"))
        return going

    monkeypatch.setattr(loop, "_turn", turn_then_a_late_probe)
    loop.start()
    loop.stop()
    assert late and isinstance(late[0].exception(timeout=2), Unavailable)


@pytest.mark.clause("SERVE-12", "SERVE-13")
def test_a_divergence_found_by_an_abort_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """SERVE-12, SERVE-13: check mode's shadow diverging while a hang-up is aborted fails the loop and counts one
    divergence, as a divergence found by a step does."""
    llm = make_llm(num_kvcache_blocks=64)
    shadow = llm.shadow
    assert shadow is not None
    metrics = Metrics()
    loop = EngineLoop(llm, metrics)

    def diverge(*args: Any) -> None:
        shadow._fail(llm.engine.scheduler, "injected by the test")

    monkeypatch.setattr(shadow, "abort", diverge)

    async def scenario() -> Any:
        stream = Stream([1, 2, 3], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                        asyncio.get_running_loop())
        loop.submit(stream)
        await stream.queue.get()
        loop.cancel(stream)

    loop.start()
    try:
        asyncio.run(scenario())
        loop.thread.join(10)
        assert loop.failure is not None and "diverging" in loop.failure
        assert metrics.registry.get_sample_value("nanoverify:check_divergences_total") == 1
    finally:
        loop.stop()


@pytest.mark.clause("SERVE-13")
def test_prefix_cache_hits_never_exceed_queries_under_preemption() -> None:
    """SERVE-13: prefix-cache queries and hits are counted on one base, each time a sequence is given blocks (a
    preempted one again, with its generated tokens), both from EngineStats: hits <= queries, and preemption
    re-admissions query more than the prompts alone."""
    llm = make_llm(num_kvcache_blocks=12, check=False)  # 4 requests of up to 34 tokens in 48 slots: preemption
    metrics = Metrics()
    loop = EngineLoop(llm, metrics)
    prompts = [[i + 1, 2, 3, 4, 5] for i in range(4)]
    scheduler = llm.engine.scheduler
    real_schedule = scheduler.schedule
    looked_up = [0]  # the oracle: the tokens of each sequence that had no blocks and was scheduled

    def schedule() -> Any:
        blockless = {id(s) for s in scheduler.waiting if not s.block_table}
        out = real_schedule()
        looked_up[0] += sum(s.num_tokens for s in out.batch if id(s) in blockless) if out.is_prefill else 0
        return out

    scheduler.schedule = schedule  # type: ignore[method-assign]

    async def scenario() -> None:
        here = asyncio.get_running_loop()
        streams = [Stream(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), here) for p in prompts]
        for stream in streams:
            loop.submit(stream)
        for stream in streams:
            await _last_event(stream)

    loop.start()
    try:
        asyncio.run(scenario())
        loop.call_between_steps(lambda: None).result(10)
    finally:
        loop.stop()
    stats = llm.engine.stats
    hits = metrics.registry.get_sample_value("nanoverify:prefix_cache_hits_total")
    queries = metrics.registry.get_sample_value("nanoverify:prefix_cache_queries_total")
    assert stats.preemptions > 0 and hits == stats.prefix_cache_hit_tokens > 0
    assert hits is not None and queries is not None and hits <= queries
    assert queries == stats.prefix_cache_query_tokens == looked_up[0] > sum(map(len, prompts))


@pytest.mark.clause("SERVE-2", "SERVE-9", "ARCH-6")
def test_a_served_request_is_validated_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """SERVE-2, SERVE-9, ARCH-6: one HTTP request runs the one validator once, and its ``SamplingParams``' value
    checks once (when the handler made it): the engine loop admits it with ``LLM.add_validated``, which checks
    nothing of the request again (before: three validations, with ``add_request`` in the loop); a Python
    ``add_request`` still re-checks the params it was handed, which may have changed since they were made."""
    import optimized.entry.requests as requests_module
    from optimized.engine import validation
    from optimized.engine.sampling_params import SamplingParams as Params

    counts = {"validate_request": 0, "params checked": 0}
    validate = validation.validate_request
    normalized = Params._normalized

    def counted_validate(*args: Any, **kwargs: Any) -> list[int]:
        counts["validate_request"] += 1
        return validate(*args, **kwargs)

    def counted_normalized(self: Params) -> dict[str, Any]:
        counts["params checked"] += 1
        return normalized(self)

    llm = make_llm(num_kvcache_blocks=16, check=False)
    server = InProcess(llm)
    try:
        monkeypatch.setattr(requests_module, "validate_request", counted_validate)
        monkeypatch.setattr(Params, "_normalized", counted_normalized)
        response = httpx.post(server.url + "/v1/completions",
                              json={"model": "default", "prompt": [1, 2], "max_tokens": 2, "temperature": 0})
        assert response.status_code == 200, response.text
        assert counts == {"validate_request": 1, "params checked": 1}
        params = SamplingParams(max_tokens=2)
        counts.update({"validate_request": 0, "params checked": 0})
        with pytest.raises(RequestRefused, match="prompt must hold at least one token"):
            llm.add_request([], params)
        assert counts == {"validate_request": 1, "params checked": 1}  # the check of what the user handed in
    finally:
        server.close()


@pytest.mark.clause("SERVE-9", "ARCH-6")
def test_the_server_answers_a_refusal_by_its_attributes_never_its_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """SERVE-9, ARCH-6: the HTTP side's refusal becomes a 400 whose param and code are the refusal's field and
    code, even when its message names neither: the server reads no message text."""
    import optimized.entry.requests as requests_module

    def refuse(*args: Any) -> list[int]:
        raise RequestRefused("top_p", "these words name no field", "a_code", "nor do these")

    monkeypatch.setattr(requests_module, "validate_request", refuse)
    server = InProcess(make_llm(num_kvcache_blocks=16, check=False))
    try:
        response = httpx.post(server.url + "/v1/completions", json={"model": "default", "prompt": [1, 2]})
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["param"], error["code"], error["type"]) == ("top_p", "a_code", "invalid_request_error")
        assert error["message"] == "top_p: these words name no field"
    finally:
        server.close()


@pytest.mark.clause("SERVE-14", "SERVE-1")
def test_bench_serve_starts_the_server_with_every_engine_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """SERVE-14: bench serve hands the server every engine flag it was given (the LLM the server builds is the one
    the offline side builds), and no API key (its client sends none). SERVE-1: serve takes all of LLM's engine
    options."""
    import argparse

    from optimized.benchmarks import serve as bench
    from optimized.cli import serve as serve_command
    from optimized.engine.args import EngineArgs

    bench_parser, serve_parser = argparse.ArgumentParser(), argparse.ArgumentParser()
    bench.add_arguments(bench_parser)
    serve_command.add_arguments(serve_parser)
    given = ["--tensor-parallel-size", "2", "--attention-backend", "torch", "--no-enforce-eager", "--check",
             "--cpu-kvcache-gib", "0.25", "--gpu-memory-utilization", "0.5", "--dtype", "float64", "--seed", "-3",
             "--max-model-len", "512", "--block-size", "8"]
    args = bench_parser.parse_args(given)
    engine = EngineArgs.from_cli_args(args)
    assert engine == EngineArgs(tensor_parallel_size=2, attention_backend="torch", enforce_eager=False, check=True,
                                cpu_kvcache_gib=0.25, gpu_memory_utilization=0.5, dtype="float64", seed=-3,
                                max_model_len=512, kvcache_block_size=8)
    assert EngineArgs.from_cli_args(serve_parser.parse_args(bench._server_flags(args))) == engine
    monkeypatch.setenv("NANOVERIFY_API_KEY", "sk-bench")
    assert "NANOVERIFY_API_KEY" not in bench.server_environment()


@pytest.mark.clause("SERVE-13")
def test_queue_time_ends_when_the_first_chunk_of_a_prompt_is_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    """SERVE-13: request_queue_time_seconds ends at the start of the step that first computed the request: for a
    prompt prefilled in chunks, the first chunk's step, not the step of its first token."""
    from optimized.serve.app import _Timing

    llm = make_llm(num_kvcache_blocks=64, check=False, max_num_batched_tokens=8)  # 40 tokens: 5 chunks
    metrics = Metrics()
    loop = EngineLoop(llm, metrics)
    step_starts: list[float] = []
    real_step = llm.step

    def step() -> Any:
        step_starts.append(time.perf_counter())
        return real_step()

    monkeypatch.setattr(llm, "step", step)

    async def scenario() -> Stream:
        stream = Stream(list(range(1, 41)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                        asyncio.get_running_loop())
        timing = _Timing(metrics, stream)
        loop.submit(stream)
        while isinstance(event := await stream.queue.get(), TokenEvent):
            timing.tokens(event)
        return stream

    loop.start()
    try:
        stream = asyncio.run(scenario())
    finally:
        loop.stop()
    queued = metrics.registry.get_sample_value("nanoverify:request_queue_time_seconds_sum")
    assert queued is not None and len(step_starts) >= 6
    assert stream.arrived + queued <= step_starts[0]  # the first step (its first chunk) began the computing


@pytest.mark.clause("SERVE-3", "SERVE-8")
def test_a_failed_step_s_output_is_delivered_even_when_the_loop_stops_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """SERVE-3, SERVE-8: a stream's events end with exactly one output or failure, even when the loop is told to
    stop while a step fails (FAULT-1): the failed output, due with the next step, is still delivered."""
    llm = make_llm(num_kvcache_blocks=64, check=False)
    loop = EngineLoop(llm, Metrics())
    real = llm.engine.runner.run
    calls = [0]

    def fail_the_second_run_and_stop(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            loop.stop()  # the server shuts down while the faulty step runs (no join: this is the loop thread)
            raise RuntimeError("injected model fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "run", fail_the_second_run_and_stop)

    async def scenario() -> Any:
        stream = Stream([1, 2, 3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        asyncio.get_running_loop())
        loop.submit(stream)
        return await _last_event(stream)

    loop.start()
    try:
        last = asyncio.run(scenario())
        assert isinstance(last, FinishEvent) and last.output.finish_reason == "error", last
    finally:
        loop.stop()


@pytest.mark.clause("SERVE-12")
def test_a_probe_whose_caller_gave_up_is_skipped_not_a_crash() -> None:
    """SERVE-7: a /health?verbose=1 read whose handler was cancelled (uvicorn cancels the tasks still open at
    shutdown, and the probe's future with them) is skipped: the loop goes on serving and answers the next one;
    refusing a cancelled probe raises nothing either (the server's reader of the engine process does that)."""
    from concurrent.futures import Future

    from optimized.serve.loop import refuse

    loop = EngineLoop(make_llm(num_kvcache_blocks=16, check=False), Metrics())
    loop.start()
    try:
        with loop._cv:  # the loop cannot take the probe before its caller gives up on it
            assert loop.engine_state().cancel()
        assert loop.engine_state().result(10).free_blocks == 16
        assert loop.failure is None and loop.alive()
    finally:
        loop.stop()
    cancelled: Future[Any] = Future()
    cancelled.cancel()
    refuse(cancelled, "the engine loop stopped")
    assert cancelled.cancelled()
    # The server's reader of the engine process, answering (or refusing) reads whose callers gave up.
    from optimized.serve.engine_process import EngineProcess

    reader = EngineProcess.__new__(EngineProcess)  # its answering half only: no process to start
    reader._lock = threading.RLock()
    reader._states = {}
    state = EngineState(16, 16, 0, 0, 0, [], 0)
    for key, ok in ((1, True), (2, False)):
        given_up: Future[EngineState] = Future()
        given_up.cancel()
        reader._states[key] = given_up
        reader._answer(key, state if ok else None, None if ok else "the engine loop stopped")
    assert reader._states == {}


@pytest.mark.clause("SERVE-12")
def test_a_verbose_health_read_the_loop_refuses_is_a_503_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """SERVE-12: when the engine read behind /health?verbose=1 is refused (the loop stopped or failed between the
    status check and the read), the answer is a 503 with the reason, not a bare 500."""
    from concurrent.futures import Future

    from optimized.serve.loop import refuse

    server = InProcess(make_llm(num_kvcache_blocks=16, check=False))
    try:
        def refused() -> Future[EngineState]:
            future: Future[EngineState] = Future()
            refuse(future, "the engine loop stopped")
            return future

        monkeypatch.setattr(server.loop, "engine_state", refused)
        health = httpx.get(server.url + "/health", params={"verbose": "1"})
        assert health.status_code == 503
        assert health.json() == {"status": "failed: the engine loop stopped"}

        def refused_at_shutdown() -> Future[EngineState]:
            server.life.draining = True  # a SIGTERM between the status check and the read
            return refused()

        monkeypatch.setattr(server.loop, "engine_state", refused_at_shutdown)
        health = httpx.get(server.url + "/health", params={"verbose": "1"})
        assert (health.status_code, health.json()) == (503, {"status": "shutting down"})  # nothing failed
    finally:
        server.close()


@pytest.mark.clause("SERVE-14")
def test_the_bench_counts_the_cpu_of_every_process_under_the_server() -> None:
    """SERVE-14: the server's CPU time includes what the processes under it spent (the engine process): here a
    parent that spends none and a child that spends 0.5 s."""
    import subprocess
    import sys

    from optimized.benchmarks.serve import ServerProcess

    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\ntime.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', "
                               f"{spin!r}])"], start_new_session=True, text=True)
    try:
        server = ServerProcess.__new__(ServerProcess)  # its measuring half only: no server to start
        server.proc = parent
        deadline = time.monotonic() + 30
        while (server.cpu_seconds() or 0) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 0.5 <= (server.cpu_seconds() or 0) < 2
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
