"""The server when its engine fails or stalls, when shutdown's aborts are slow, on a busy port, and the names it
serves under (SERVE-8, SERVE-19..23): spawned servers, real signals, real gloo workers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from optimized.cli import main as cli_main
from optimized.cli.command import build_parser
from optimized.cli.serve import server_options
from tests.engine_fixtures import with_config
from tests.test_serve import ROOT, Served, spawn, stop
from tests.test_serve_lifecycle import stream_lines
from tests.test_serve_process import children, engine_pid, metric_value

pytestmark = pytest.mark.usefixtures("engine_env")


def spawned_children(pid: int) -> list[int]:
    return [child for child in children(pid) if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()]


def health_until(served: Served, status: int, seconds: float) -> httpx.Response:
    """/health polled until it answers ``status`` (the last answer, whatever it is, after ``seconds``)."""
    deadline = time.monotonic() + seconds
    while True:
        answer = served.get("/health")
        if answer.status_code == status or time.monotonic() > deadline:
            return answer
        time.sleep(0.1)


@pytest.mark.clause("SERVE-19", "SERVE-20", "TP-9")
def test_a_dead_tensor_parallel_worker_turns_health_503_naming_its_rank(serve_cache: Path) -> None:
    """SERVE-19: ``serve --tensor-parallel-size 2`` with its worker killed (SIGKILL) while the server is idle:
    within seconds, and before any request finds it, /health is 503 naming the rank, its pid and the signal; a
    request is refused with a 503 saying the same; the gauges read 0 and SIGTERM ends the server with status 3
    (SERVE-20)."""
    served = spawn(["--tensor-parallel-size", "2", "--num-kvcache-blocks", "64"], serve_cache / "tp-dead.log")
    try:
        ok = httpx.post(served.url + "/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 2},
                        timeout=60)
        assert ok.status_code == 200, ok.text
        workers = spawned_children(engine_pid(served))
        assert len(workers) == 1, workers
        assert served.get("/health").status_code == 200
        os.kill(workers[0], signal.SIGKILL)
        killed = time.monotonic()
        health = health_until(served, 503, 20)
        assert health.status_code == 503, health.text
        assert time.monotonic() - killed < 10
        status = health.json()["status"]
        assert f"tensor-parallel rank 1 (pid {workers[0]}) was killed by signal 9" in status, status
        late = httpx.post(served.url + "/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 2},
                          timeout=30)
        assert late.status_code == 503, late.text
        assert "tensor-parallel rank 1" in late.json()["error"]["message"]
        assert metric_value(served.get("/metrics").text, "nanoverify:num_requests_running") == 0
    finally:
        code = stop(served)
    assert code == 3, (served.log.read_text()[-3000:])


@pytest.mark.clause("SERVE-21", "SERVE-8")
def test_a_frozen_engine_is_stalled_then_healthy_and_late_aborts_still_end_every_stream(serve_cache: Path) -> None:
    """SERVE-21: the engine process stopped (SIGSTOP) with streams in flight: past ``--step-timeout`` /health is
    503 saying how long no step has finished, and a new request is refused (503); resumed (SIGCONT), /health is
    200 again. SERVE-8: then SIGTERM, and the grace period ends and the aborts are asked for while the engine
    cannot answer (stopped again from just after SIGTERM until 7 s later, as a long step or a costly abort would
    hold it): every stream still ends with its abort chunk and [DONE] once the engine delivers them, none is cut
    off, and a stall that ended is no loss: the server exits 0 (one server for both: each costs a model load)."""
    folder = with_config("qwen3", "long-context", max_position_embeddings=8192)
    served = spawn(["--model", str(folder), "--step-timeout", "2", "--shutdown-timeout", "1", "--max-num-seqs", "8"],
                   serve_cache / "frozen.log")
    engine = engine_pid(served)
    try:
        body = {"model": folder.name, "prompt": [1, 2], "max_tokens": 8000, "ignore_eos": True, "stream": True,
                "return_token_ids": True}
        outs: list[list[str]] = [[] for _ in range(6)]
        seen = [threading.Event() for _ in outs]
        with httpx.Client() as client:
            readers = [threading.Thread(target=stream_lines, args=(client, served.url + "/v1/completions", body,
                                                                   seen[i], outs[i])) for i in range(len(outs))]
            for reader in readers:
                reader.start()
            assert all(s.wait(60) for s in seen)
            assert served.get("/health").status_code == 200
            os.kill(engine, signal.SIGSTOP)
            frozen = time.monotonic()
            health = health_until(served, 503, 20)
            assert health.status_code == 503, health.text
            assert time.monotonic() - frozen >= 2
            status = health.json()["status"]
            assert "has not finished a step for" in status and "stalled" in status and "--step-timeout" in status
            late = httpx.post(served.url + "/v1/completions",
                              json={"model": folder.name, "prompt": [1], "max_tokens": 2}, timeout=30)
            assert late.status_code == 503 and "stalled" in late.json()["error"]["message"]
            os.kill(engine, signal.SIGCONT)
            assert health_until(served, 200, 20).status_code == 200
            served.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            os.kill(engine, signal.SIGSTOP)  # before the grace period (1 s) ends
            time.sleep(6.5)  # past the old fixed settle time (2 s) and uvicorn's own (2 s) after it
            os.kill(engine, signal.SIGCONT)
            for reader in readers:
                reader.join(60)
        assert served.proc.wait(60) == 0
        for out in outs:
            assert out[-1] == "[DONE]", out[-3:]
            assert json.loads(out[-2])["choices"][0]["finish_reason"] == "abort", out[-3:]
    finally:
        with contextlib.suppress(OSError):
            os.kill(engine, signal.SIGCONT)
        stop(served)


@pytest.mark.clause("SERVE-23")
def test_a_busy_port_is_one_line_and_status_2_before_the_model_loads() -> None:
    """SERVE-23: ``serve`` on a port another socket holds prints exactly one line naming the address and the
    reason and exits 2, without starting the engine process (nothing of the model's loading is logged)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-m", "optimized.cli", "serve", "--port", str(port)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"nanoverify serve: could not listen on 127.0.0.1:{port}: "), lines
    assert "in use" in lines[0] and done.stdout == ""


@pytest.mark.clause("SERVE-22")
def test_served_under_the_model_argument_its_folder_and_served_model_name(serve_cache: Path) -> None:
    """SERVE-22: ``--model PATH`` is served under PATH as given (the name answers carry and /v1/models lists
    first) and under its folder's name; another name is a 404; ``--served-model-name A B`` replaces both (the
    options are built as the served ones are, without a second model load); a blank name is
    refused before anything loads."""
    folder = with_config("qwen3", "long-context", max_position_embeddings=8192)
    assert cli_main(["serve", "--model", str(folder), "--served-model-name", " "]) == 2
    served = spawn(["--model", str(folder)], serve_cache / "names.log")
    try:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == [str(folder), folder.name]
        for name in (str(folder), folder.name):
            answer = client.completions.create(model=name, prompt=[1, 2], max_tokens=2)
            assert answer.model == str(folder) and answer.choices[0].finish_reason == "length"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="default", prompt=[1, 2], max_tokens=2)
    finally:
        code = stop(served)
    assert code == 0
    args = build_parser().parse_args(["serve", "--model", str(folder), "--served-model-name", "tiny", "tiny-alias"])
    options = server_options(args, {})  # what the server above was given, from other arguments
    assert (options.served_model, options.other_names) == ("tiny", ("tiny-alias",))


@pytest.mark.clause("SERVE-23")
def test_the_bound_socket_is_closed_when_serving_cannot_begin(tmp_path: Path) -> None:
    """SERVE-23: the socket bound before the model loaded is closed (and the loop stopped) when serving fails
    before uvicorn runs, here on a checkpoint whose tokenizer_config.json is not JSON (the chat template's)."""
    from optimized import LLM
    from optimized.serve.app import ServerOptions
    from optimized.serve.loop import EngineInfo, EngineLoop
    from optimized.serve.metrics import Metrics
    from optimized.serve.server import listening_socket, serve
    from tests.engine_fixtures import checkpoint

    llm = LLM(str(checkpoint("qwen3")), num_kvcache_blocks=16)
    try:
        (tmp_path / "tokenizer_config.json").write_text("{")
        metrics = Metrics()
        sock = listening_socket("127.0.0.1", 0)
        with pytest.raises(ValueError, match="not readable JSON"):
            serve(EngineLoop(llm, metrics), EngineInfo(llm.limits, tmp_path), metrics, sock, ServerOptions(), 1)
        assert sock.fileno() == -1
    finally:
        llm.close()
