"""``nanoverify serve`` end to end: the real ``openai`` client against a spawned server (spec/serve.md).

One server per module (float64, check mode, an API key), spawned as users start it, and one offline ``LLM`` on
the same default model: the oracle of served == offline.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest

from optimized import LLM, SamplingParams
from optimized.engine.validation import RequestRefused

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-test-0123456789"
BLOCKS = 128  # x 16 tokens: 2048 tokens of KV cache, below max_model_len (4096): a request can fit one, not the other
STARTUP_SECONDS = 120


@dataclass
class Served:
    proc: subprocess.Popen[str]
    url: str
    log: Path

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=60)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30, **kw)

    def post(self, path: str, body: bytes | str, key: str | None = KEY, **headers: str) -> httpx.Response:
        auth = {"Authorization": f"Bearer {key}"} if key is not None else {}
        return httpx.post(self.url + path, content=body, headers={**auth, **headers}, timeout=30)


def spawn(args: list[str], log: Path, own_session: bool = False) -> Served:
    """``python -m optimized.cli serve ARGS --port 0``, once it says where it listens; ``own_session``: in a
    process group of its own, as a shell's foreground job is."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "optimized.cli", "serve", "--port", "0", *args], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=own_session)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline and proc.poll() is None:
        url = next((line.split("listening on ")[1].strip() for line in lines if "listening on" in line), None)
        if url:
            return Served(proc, url, log)
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise AssertionError(f"the server did not start (exit {proc.poll()}):\n{log.read_text()}")


def stop(served: Served) -> int:
    if served.proc.poll() is None:
        served.proc.terminate()
    try:
        return served.proc.wait(30)
    finally:
        if served.proc.poll() is None:
            served.proc.kill()
            served.proc.wait()


@pytest.fixture(scope="module")
def offline(serve_cache: Path) -> LLM:
    """The default model in float64 (it is made here, in the module's cache, before the server loads it); no check
    mode here: the server runs in check mode."""
    return LLM(None, dtype="float64", num_kvcache_blocks=BLOCKS)


@pytest.fixture(scope="module")
def server(offline: LLM, serve_cache: Path) -> Iterator[Served]:
    served = spawn(["--dtype", "float64", "--check", "--api-key", KEY, "--num-kvcache-blocks", str(BLOCKS)],
                   serve_cache / "server.log")
    try:
        yield served
    finally:
        stop(served)


def sampled(seed: int, max_tokens: int = 24, **extra: Any) -> SamplingParams:
    return SamplingParams(temperature=0.9, max_tokens=max_tokens, seed=seed, ignore_eos=True, **extra)


def body(prompt: str | list[int], params: SamplingParams, **extra: Any) -> dict[str, Any]:
    """The completion request's arguments for ``params`` (temperature, seed, max_tokens, ignore_eos)."""
    return {"model": "default", "prompt": prompt, "max_tokens": params.max_tokens, "temperature": params.temperature,
            "seed": params.seed, "extra_body": {"ignore_eos": params.ignore_eos, "return_token_ids": True}, **extra}


def token_ids(choice: Any) -> list[int]:
    """vLLM's extra ``token_ids`` of a choice (asked for with ``return_token_ids``)."""
    ids: list[int] = choice.model_extra["token_ids"]
    return ids


def chunks_of(stream: Any) -> list[Any]:
    return list(stream)


@pytest.mark.clause("SERVE-1", "SERVE-4")
def test_completions_and_chat_whole_and_streamed(server: Served, offline: LLM) -> None:
    """SERVE-1, SERVE-4: both endpoints, whole and streamed: the offline text and tokens, usage, finish_reason;
    the streamed pieces join to the whole text, finish_reason only on the last content chunk, then the usage
    chunk (empty choices) when asked."""
    client = server.client
    params = sampled(11, 12)
    want = offline.generate(["Hello"], params, use_tqdm=False)[0]
    whole = client.completions.create(**body("Hello", params))
    assert whole.choices[0].text == want.text and whole.choices[0].finish_reason == "length"
    assert token_ids(whole.choices[0]) == want.token_ids
    assert whole.usage is not None and (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (5, 12)
    assert whole.usage.total_tokens == 17 and whole.object == "text_completion" and whole.model == "default"
    chunks = chunks_of(client.completions.create(**body("Hello", params), stream=True,
                                                 stream_options={"include_usage": True}))
    content, usage = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in content) == want.text
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["length"]
    assert usage.choices == [] and usage.usage.completion_tokens == 12 and usage.usage.prompt_tokens == 5
    # Chat: the default model's template, the same tokens as offline on the rendered prompt.
    rendered = "<|user|>\nHi\n<|assistant|>\n"
    want = offline.generate([rendered], sampled(3, 8), use_tqdm=False)[0]
    chat = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                          max_completion_tokens=8, temperature=0.9, seed=3,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == want.text and chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.prompt_tokens == len(rendered) and chat.object == "chat.completion"
    chunks = chunks_of(client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0.9, seed=3,
        stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None
    # An EOS ends a request with "stop": greedy from this prompt draws EOS early (found offline).
    eos = next(o for o in offline.generate([f"p{i}" for i in range(40)], SamplingParams(temperature=0.9, seed=5,
               max_tokens=64), use_tqdm=False) if o.finish_reason == "stop")
    got = client.completions.create(model="default", prompt=eos.prompt or "", max_tokens=64, temperature=0.9, seed=5)
    assert got.choices[0].finish_reason == "stop" and got.choices[0].text == eos.text
    assert [m.id for m in client.models.list().data] == ["default"]


def legacy_logprobs(offline: LLM, out: Any, offset: int = 0) -> dict[str, Any]:
    """SERVE-6's completions shape for an offline output, built here from its ``Logprob`` dicts."""
    text = [offline.tokenizer.decode([t]) for t in out.token_ids]
    tops = []
    for entry in out.logprobs:
        top: dict[str, float] = {}
        for t, lp in entry.items():
            top.setdefault(offline.tokenizer.decode([t]), lp.logprob)
        tops.append(top)
    return {"tokens": text, "token_logprobs": [e[t].logprob for t, e in zip(out.token_ids, out.logprobs, strict=True)],
            "top_logprobs": tops, "text_offset": [offset + sum(map(len, text[:i])) for i in range(len(text))]}


def chat_logprobs(offline: LLM, out: Any, k: int) -> list[dict[str, Any]]:
    """SERVE-6's chat ``content`` for an offline output."""
    def one(t: int, value: float) -> dict[str, Any]:
        text = offline.tokenizer.decode([t])
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    return [{**one(t, e[t].logprob), "top_logprobs": [one(i, lp.logprob) for i, lp in e.items() if lp.rank <= k]}
            for t, e in zip(out.token_ids, out.logprobs, strict=True)]


@pytest.mark.clause("SERVE-6", "ENG-18")
def test_logprobs_served_equal_offline(server: Served, offline: LLM) -> None:
    """SERVE-6: completions' ``logprobs: K`` and chat's ``logprobs`` with ``top_logprobs: K``, whole and
    streamed, parsed by the openai client, carry exactly the offline LLM's float64 logprobs in OpenAI's shapes."""
    client = server.client
    params = sampled(21, 10, logprobs=3)
    want = offline.generate(["Hello"], params, use_tqdm=False)[0]
    expected = legacy_logprobs(offline, want)
    whole = client.completions.create(**body("Hello", params), logprobs=3)
    assert token_ids(whole.choices[0]) == want.token_ids
    assert whole.choices[0].logprobs is not None and whole.choices[0].logprobs.model_dump() == expected
    streamed: dict[str, list[Any]] = {name: [] for name in expected}
    for chunk in client.completions.create(**body("Hello", params), logprobs=3, stream=True):
        if chunk.choices[0].logprobs is not None:
            for name, values in chunk.choices[0].logprobs.model_dump().items():
                streamed[name] += values
    assert streamed == expected
    rendered = "<|user|>\nHi\n<|assistant|>\n"
    want = offline.generate([rendered], sampled(3, 8, logprobs=2), use_tqdm=False)[0]
    content = chat_logprobs(offline, want, 2)
    asked: dict[str, Any] = {"model": "default", "messages": [{"role": "user", "content": "Hi"}],
                             "max_completion_tokens": 8, "temperature": 0.9, "seed": 3,
                             "extra_body": {"ignore_eos": True}, "logprobs": True, "top_logprobs": 2}
    chat = client.chat.completions.create(**asked)
    assert chat.choices[0].logprobs is not None
    assert [c.model_dump() for c in chat.choices[0].logprobs.content or []] == content
    pieces = [c.model_dump() for chunk in client.chat.completions.create(**asked, stream=True)
              if chunk.choices and chunk.choices[0].logprobs is not None
              for c in chunk.choices[0].logprobs.content or []]
    assert pieces == content
    plain = client.chat.completions.create(**{**asked, "logprobs": False, "top_logprobs": 0})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == want.text


@pytest.mark.clause("SERVE-5")
def test_generate_ends_at_the_token_completing_a_stop_string(offline: LLM) -> None:
    """SERVE-5: LLM.generate honours stop strings: the request ends at the token that completes one (through the
    abort path; the served test below runs it in check mode), finish_reason "stop", text cut before the stop
    string; the blocks are free afterwards. Byte-level tokens: a 3-character stop string spans 3 tokens."""
    params = SamplingParams(temperature=0.9, max_tokens=40, seed=7, ignore_eos=True)
    full = offline.generate(["Hello"], params, use_tqdm=False)[0]
    ascii_at = next(i for i in range(5, 30) if full.text[i : i + 3].isascii() and full.text[i : i + 3].isprintable())
    stop = full.text[ascii_at : ascii_at + 3]
    cut = full.text.index(stop)
    aborted_before = offline.engine.stats.aborted_requests
    out = offline.generate(["Hello"], SamplingParams(**{**params.__dict__, "stop": (stop,)}), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.text == full.text[:cut]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < len(full.token_ids)
    assert offline.tokenizer.decode(out.token_ids).endswith(stop)  # the completing token is the last one
    assert not offline.tokenizer.decode(out.token_ids[:-1]).endswith(stop)
    assert offline.engine.stats.aborted_requests == aborted_before  # ended as "stop", not counted as an abort
    assert len(offline.engine.scheduler.block_manager.free_block_ids) == BLOCKS


@pytest.mark.clause("SERVE-5")
def test_stop_strings_across_token_boundaries(server: Served, offline: LLM) -> None:
    """SERVE-5: a stop string spanning several tokens ends the request at the token completing it, whole or
    streamed; the text stops before it; the same as LLM.generate with the same stop."""
    params = sampled(21, 40)
    full = offline.generate(["Hello"], params, use_tqdm=False)[0]
    at = next(i for i in range(4, 30) if full.text[i : i + 3].isascii() and full.text[i : i + 3].isprintable()
              and full.text.index(full.text[i : i + 3]) == i)
    stop = full.text[at : at + 3]
    want = offline.generate(["Hello"], sampled(21, 40, stop=(stop, "never-there")), use_tqdm=False)[0]
    assert want.text == full.text[:at] and want.finish_reason == "stop"
    whole = server.client.completions.create(**body("Hello", params), stop=[stop, "never-there"])
    assert whole.choices[0].text == full.text[:at] and whole.choices[0].finish_reason == "stop"
    assert token_ids(whole.choices[0]) == want.token_ids
    assert len(want.token_ids) < len(full.token_ids)
    chunks = chunks_of(server.client.completions.create(**body("Hello", params), stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.text[:at]
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.clause("SERVE-4")
def test_a_multibyte_character_split_across_tokens_arrives_whole(server: Served, offline: LLM) -> None:
    """SERVE-4: the default model's tokens are bytes, so a non-ASCII character spans tokens; streamed, it arrives
    whole in one piece (a split one would arrive as two U+FFFD and the pieces would not join to the text)."""
    found = None
    for seed in range(200):
        out = offline.generate(["Gr\u00fc\u00dfe"], sampled(seed, 48), use_tqdm=False)[0]
        chars = [c for c in out.text if ord(c) > 127 and c != "\ufffd"]
        if chars:
            found = seed, out, chars[0]
            break
    assert found is not None, "no seed drew a whole multi-byte character"
    seed, out, char = found
    chunks = chunks_of(server.client.completions.create(**body("Gr\u00fc\u00dfe", sampled(seed, 48)), stream=True))
    pieces = [c.choices[0].text for c in chunks]
    assert "".join(pieces) == out.text
    assert any(char in p for p in pieces)


@pytest.mark.clause("SERVE-3", "SERVE-2")
def test_served_equals_offline_with_32_concurrent_clients(server: Served, offline: LLM) -> None:
    """SERVE-3: 32 clients at once, seeded, temperature > 0: each gets exactly the tokens LLM.generate returns
    for its request alone (float64; the sampler is batch-invariant, ENG-8): the server adds nothing."""
    prompts = [f"client {i}: " + "ab" * (i % 7) for i in range(32)]
    params = [sampled(100 + i, 8 + i % 5) for i in range(32)]

    def ask(i: int) -> list[int]:
        got = server.client.completions.create(**body(prompts[i], params[i]))
        return token_ids(got.choices[0])

    with ThreadPoolExecutor(32) as pool:
        served = list(pool.map(ask, range(32)))
    for i in range(32):
        assert served[i] == offline.generate([prompts[i]], params[i], use_tqdm=False)[0].token_ids, i


def engine_state(server: Served) -> dict[str, Any]:
    """The engine between steps once it is idle (SERVE-7's /health?verbose=1)."""
    deadline = time.monotonic() + 30
    while True:
        state: dict[str, Any] = server.get("/health", params={"verbose": "1"}).json()["engine"]
        if state["running"] == state["waiting"] == 0 or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


def metric(server: Served, name: str) -> float:
    for line in server.get("/metrics").text.splitlines():
        if line.rsplit(" ", 1)[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.clause("SERVE-7", "SERVE-12", "SERVE-13")
def test_clients_that_hang_up_free_their_blocks(server: Served, offline: LLM) -> None:
    """SERVE-7: 50 streaming clients, half hang up at random points; the others get complete answers (the
    offline tokens); afterwards every block is free and every invariant holds on the engine's scheduler (read
    between steps through /health?verbose=1); each hang-up was aborted, and check mode compared every step
    with zero divergences (health stays 200)."""
    rng = random.Random(0)
    aborted_before = metric(server, 'nanoverify:request_success_total{finished_reason="abort"}')
    compared_before = engine_state(server)["compared_steps"]
    hangups = set(rng.sample(range(50), 25))

    def client(i: int) -> tuple[int, list[int]]:
        params = sampled(500 + i, 1000 if i in hangups else 20)
        stream = server.client.completions.create(**body(f"user {i}", params), stream=True)
        tokens: list[int] = []
        leave_after = rng.randrange(1, 8) if i in hangups else None
        for n, chunk in enumerate(stream, 1):
            tokens += chunk.choices[0].model_extra.get("token_ids", [])
            if n == leave_after:
                stream.close()
                break
        return i, tokens

    with ThreadPoolExecutor(50) as pool:
        results = dict(pool.map(client, range(50)))
    stayed = sorted(set(range(50)) - hangups)
    wanted = offline.generate([f"user {i}" for i in stayed], [sampled(500 + i, 20) for i in stayed], use_tqdm=False)
    assert [results[i] for i in stayed] == [w.token_ids for w in wanted]  # batched: ENG-8 makes it the same
    state = engine_state(server)
    assert state["running"] == state["waiting"] == 0
    assert state["free_blocks"] == state["num_blocks"] == BLOCKS
    assert state["violations"] == []
    assert state["compared_steps"] > compared_before
    assert metric(server, "nanoverify:num_requests_running") == metric(server, "nanoverify:num_requests_waiting") == 0
    assert metric(server, "nanoverify:kv_cache_usage_perc") == 0  # SERVE-13: gauges as the engine is, exactly
    aborted = metric(server, 'nanoverify:request_success_total{finished_reason="abort"}') - aborted_before
    assert aborted == 25  # 1000 tokens each: every one hung up before it could finish
    assert metric(server, "nanoverify:check_divergences_total") == 0
    assert server.get("/health").status_code == 200


BAD: list[tuple[str, str, dict[str, Any] | bytes, int, str | None, str]] = [
    # (name, path, body, status, param, words in the message)
    ("malformed JSON", "/v1/completions", b'{"model": "default", "prompt": ', 400, None, "not valid JSON"),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("no model", "/v1/completions", {"prompt": "x"}, 400, "model", "required"),
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "default"),
    ("no prompt", "/v1/completions", {"model": "default"}, 400, "prompt", "required"),
    ("prompt a number", "/v1/completions", {"model": "default", "prompt": 5}, 400, "prompt", "valid"),
    ("prompt empty ids", "/v1/completions", {"model": "default", "prompt": []}, 400, "prompt", "at least one token"),
    ("negative id", "/v1/completions", {"model": "default", "prompt": [1, -2]}, 400, "prompt", "vocab_size"),
    ("id past vocab", "/v1/completions", {"model": "default", "prompt": [1, 999]}, 400, "prompt", "vocab_size"),
    ("max_tokens a string", "/v1/completions", {"model": "default", "prompt": "x", "max_tokens": "5"}, 400,
     "max_tokens", "integer"),
    ("max_tokens 0", "/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 0}, 400, "max_tokens",
     "max_tokens: must be an integer >= 1"),
    ("max_model_len", "/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 5000}, 400,
     "max_tokens", "max_tokens: is too large: 5000 + 1 prompt tokens exceeds max_model_len=4096"),
    ("never fits the cache", "/v1/completions", {"model": "default", "prompt": "xy", "max_tokens": 3000}, 400,
     "max_tokens", "num_kvcache_blocks=128"),
    ("temperature a bool", "/v1/completions", {"model": "default", "prompt": "x", "temperature": True}, 400,
     "temperature", "number"),
    ("temperature 3", "/v1/completions", {"model": "default", "prompt": "x", "temperature": 3}, 400,
     "temperature", "temperature: must be in [0, 2]"),
    ("top_p 0", "/v1/completions", {"model": "default", "prompt": "x", "top_p": 0}, 400, "top_p", "in (0, 1]"),
    ("top_k -2", "/v1/completions", {"model": "default", "prompt": "x", "top_k": -2}, 400, "top_k",
     "-1 or 0 (off) or a positive integer"),
    ("seed a float", "/v1/completions", {"model": "default", "prompt": "x", "seed": 1.5}, 400, "seed", "integer"),
    ("five stops", "/v1/completions", {"model": "default", "prompt": "x", "stop": list("abcde")}, 400, "stop",
     "at most 4"),
    ("empty stop", "/v1/completions", {"model": "default", "prompt": "x", "stop": [""]}, 400, "stop",
     "non-empty strings"),
    ("n 2", "/v1/completions", {"model": "default", "prompt": "x", "n": 2}, 400, "n", "n=1"),
    ("stream a string", "/v1/completions", {"model": "default", "prompt": "x", "stream": "yes"}, 400, "stream",
     "boolean"),
    ("include_usage", "/v1/completions", {"model": "default", "prompt": "x", "stream_options": {"include_usage": 1}},
     400, "stream_options.include_usage", "boolean"),
    ("stop id past vocab", "/v1/completions", {"model": "default", "prompt": "x", "stop_token_ids": [300]}, 400,
     "stop_token_ids", "vocab_size"),
    ("no messages", "/v1/chat/completions", {"model": "default", "messages": []}, 400, "messages", "at least 1"),
    ("bad role", "/v1/chat/completions", {"model": "default", "messages": [{"role": "bot", "content": "x"}]}, 400,
     "messages.0.role", "user"),
    ("content a number", "/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": 1}]},
     400, "messages.0.content", "valid"),
    ("lone surrogate prompt", "/v1/completions", b'{"model": "default", "prompt": "a\\ud800"}', 400, "prompt",
     "not valid Unicode"),
    ("lone surrogate message", "/v1/chat/completions",
     b'{"model": "default", "messages": [{"role": "user", "content": "\\udfff"}]}', 400, "messages",
     "messages: text is not valid Unicode"),
    ("prompt past max_model_len", "/v1/completions", {"model": "default", "prompt": "x" * 4100}, 400, "prompt",
     "prompt: is too long: 4100 tokens + one completion token exceeds max_model_len=4096"),
    ("prompt past the cache", "/v1/completions", {"model": "default", "prompt": "x" * 2100, "max_tokens": 1}, 400,
     "prompt", "num_kvcache_blocks=128"),
    ("messages past the cache, max_tokens defaulted", "/v1/chat/completions",
     {"model": "default", "messages": [{"role": "user", "content": "x" * 2100}]}, 400, "messages",
     "one completion token can never fit the KV cache (num_kvcache_blocks=128"),
    ("echo", "/v1/completions", {"model": "default", "prompt": "x", "echo": True}, 400, "echo", "not supported"),
    ("logprobs 21", "/v1/completions", {"model": "default", "prompt": "x", "logprobs": 21}, 400, "logprobs",
     "logprobs: must be None or an integer in [0, 20], got 21"),
    ("logprobs a bool", "/v1/completions", {"model": "default", "prompt": "x", "logprobs": True}, 400, "logprobs",
     "logprobs: "),
    ("chat logprobs a number", "/v1/chat/completions",
     {"model": "default", "messages": [{"role": "user", "content": "x"}], "logprobs": 1}, 400, "logprobs",
     "logprobs: "),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"model": "default", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400, "top_logprobs",
     "needs logprobs set to true"),
    ("top_logprobs 21", "/v1/chat/completions",
     {"model": "default", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs", "top_logprobs: must be None or an integer in [0, 20], got 21"),
    ("top_logprobs -1", "/v1/chat/completions",
     {"model": "default", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": -1}, 400,
     "top_logprobs", "top_logprobs: must be None or an integer in [0, 20], got -1"),
    ("best_of 2", "/v1/completions", {"model": "default", "prompt": "x", "best_of": 2}, 400, "best_of",
     "not supported"),
    ("suffix", "/v1/completions", {"model": "default", "prompt": "x", "suffix": "end"}, 400, "suffix",
     "not supported"),
    ("presence_penalty", "/v1/completions", {"model": "default", "prompt": "x", "presence_penalty": 0.5}, 400,
     "presence_penalty", "not supported"),
    ("frequency_penalty", "/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}],
     "frequency_penalty": -1}, 400, "frequency_penalty", "not supported"),
    ("logit_bias", "/v1/completions", {"model": "default", "prompt": "x", "logit_bias": {"5": 100}}, 400,
     "logit_bias", "not supported"),
    ("response_format json", "/v1/chat/completions", {"model": "default", "messages": [{"role": "user",
     "content": "x"}], "response_format": {"type": "json_object"}}, 400, "response_format", "not supported"),
    ("max_completion_tokens -1", "/v1/chat/completions",
     {"model": "default", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}, 400,
     "max_completion_tokens", "max_completion_tokens: must be an integer >= 1"),
    ("max_completion_tokens past max_model_len", "/v1/chat/completions",
     {"model": "default", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000}, 400,
     "max_completion_tokens", "max_completion_tokens: is too large: 5000 + "),
    ("max_tokens -1 beside max_completion_tokens", "/v1/chat/completions",
     {"model": "default", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1,
      "max_completion_tokens": 2}, 400, "max_tokens", "set one of max_tokens and max_completion_tokens"),
    ("a bool among the prompt's ids", "/v1/completions", {"model": "default", "prompt": [True]}, 400, "prompt",
     "prompt.0: "),
    ("a bool among the stop ids", "/v1/completions", {"model": "default", "prompt": "x", "stop_token_ids": [True]},
     400, "stop_token_ids", "stop_token_ids.0: "),
]


@pytest.mark.clause("SERVE-9")
@pytest.mark.parametrize(("name", "path", "payload", "status", "param", "words"), BAD, ids=[b[0] for b in BAD])
def test_bad_requests_are_refused_with_openai_errors(server: Served, name: str, path: str,
                                                     payload: dict[str, Any] | bytes, status: int, param: str | None,
                                                     words: str) -> None:
    """SERVE-9: each wrong type, range or limit is its status with OpenAI's error JSON naming the field."""
    raw = payload if isinstance(payload, bytes) else json.dumps(payload)
    response = server.post(path, raw, **{"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"], error


# (name, the completion body's fields, the param and code both paths name); the Python side asks for the same
# prompt (default "x") and SamplingParams, with the server's default max_tokens (16).
RULES: list[tuple[str, dict[str, Any], str, str | None]] = [
    ("temperature above 2", {"temperature": 2.5}, "temperature", None),
    ("temperature negative", {"temperature": -0.1}, "temperature", None),
    ("temperature NaN", {"temperature": math.nan}, "temperature", None),
    ("temperature a string", {"temperature": "hot"}, "temperature", None),
    ("top_p 0", {"top_p": 0.0}, "top_p", None),
    ("top_p NaN", {"top_p": math.nan}, "top_p", None),
    ("top_k -2", {"top_k": -2}, "top_k", None),
    ("top_k a float", {"top_k": 1.5}, "top_k", None),
    ("max_tokens 0", {"max_tokens": 0}, "max_tokens", None),
    ("seed a float", {"seed": 1.5}, "seed", None),
    ("ignore_eos a string", {"ignore_eos": "yes"}, "ignore_eos", None),
    ("an empty stop", {"stop": [""]}, "stop", None),
    ("five stops", {"stop": list("abcde")}, "stop", None),
    ("a negative stop id", {"stop_token_ids": [-1]}, "stop_token_ids", None),
    ("a stop id past the vocabulary", {"stop_token_ids": [300]}, "stop_token_ids", None),
    ("an empty prompt", {"prompt": []}, "prompt", None),
    ("a prompt id past the vocabulary", {"prompt": [1, 999]}, "prompt", None),
    ("a negative prompt id", {"prompt": [1, -2]}, "prompt", None),
    ("a bool among the prompt's ids", {"prompt": [True]}, "prompt", None),
    ("a bool among the stop ids", {"stop_token_ids": [True]}, "stop_token_ids", None),
    ("logprobs 21", {"logprobs": 21}, "logprobs", None),
    ("logprobs -1", {"logprobs": -1}, "logprobs", None),
    ("logprobs a float", {"logprobs": 1.5}, "logprobs", None),
    ("logprobs a bool", {"logprobs": True}, "logprobs", None),
    ("past max_model_len by max_tokens", {"max_tokens": 5000}, "max_tokens", "context_length_exceeded"),
    ("past the cache by max_tokens", {"prompt": "xy", "max_tokens": 3000}, "max_tokens", "context_length_exceeded"),
    ("a prompt past max_model_len", {"prompt": "x" * 4100}, "prompt", "context_length_exceeded"),
    ("a prompt past the cache", {"prompt": "x" * 2100, "max_tokens": 1}, "prompt", "context_length_exceeded"),
]


@pytest.mark.clause("ARCH-6", "SERVE-9", "ENG-10")
@pytest.mark.parametrize(("name", "fields", "param", "code"), RULES, ids=[r[0] for r in RULES])
def test_http_and_python_refuse_alike(server: Served, offline: LLM, name: str, fields: dict[str, Any], param: str,
                                      code: str | None) -> None:
    """ARCH-6: each rule refuses the same request in Python (a RequestRefused carrying the field and code) and over
    HTTP (a 400 whose param and code are the same), and the Python refusal changes nothing."""
    sampling = {"max_tokens": 16, **{k: v for k, v in fields.items() if k != "prompt"}}
    prompt = fields.get("prompt", "x")
    with pytest.raises(RequestRefused) as refused:
        offline.add_request(prompt, SamplingParams(**sampling))
    assert (refused.value.field, refused.value.code) == (param, code)
    assert not offline.has_unfinished_requests()
    response = server.post("/v1/completions", json.dumps({"model": "default", "prompt": prompt, **sampling}))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error"), error


@pytest.mark.clause("SERVE-9")
def test_a_chat_sets_one_of_max_tokens_and_max_completion_tokens(server: Served) -> None:
    """SERVE-9: a chat that sets both limits must set them alike (else max_tokens would be dropped unchecked: a
    -1 beside a good max_completion_tokens was a 200); equal, they are one limit."""
    chat = server.client.chat.completions
    messages: Any = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.BadRequestError) as refused:
        chat.create(model="default", messages=messages, max_tokens=-1, max_completion_tokens=2)
    assert refused.value.param == "max_tokens" and "set one of max_tokens and max_completion_tokens" in str(
        refused.value), refused.value
    same = chat.create(model="default", messages=messages, max_tokens=3, max_completion_tokens=3, temperature=0,
                       extra_body={"ignore_eos": True})
    assert same.usage is not None and same.usage.completion_tokens == 3


@pytest.mark.clause("ARCH-6", "ENG-10", "SERVE-1")
def test_top_k_zero_and_temperature_two_are_taken_alike(server: Served, offline: LLM) -> None:
    """ARCH-6: top_k 0 means off (vLLM's meaning; stored as -1) in Python and over HTTP, and temperature 2 (the
    bound) is taken by both: the served tokens are LLM.generate's with top_k -1."""
    assert SamplingParams(top_k=0).top_k == -1
    for temperature in (0.9, 2.0):
        params = sampled(31, 10, top_k=-1)
        params = SamplingParams(**{**params.__dict__, "temperature": temperature})
        want = offline.generate(["Hello"], params, use_tqdm=False)[0].token_ids
        assert offline.generate(["Hello"], SamplingParams(**{**params.__dict__, "top_k": 0}),
                                use_tqdm=False)[0].token_ids == want
        request = body("Hello", params)
        request["extra_body"] = {**request["extra_body"], "top_k": 0}
        assert token_ids(server.client.completions.create(**request).choices[0]) == want


@pytest.mark.clause("SERVE-9", "SERVE-11")
def test_keys_bodies_and_the_server_keeps_serving(server: Served) -> None:
    """SERVE-11: no key or a wrong key is a 401 (the openai client's AuthenticationError) on every /v1 path;
    /health and /metrics need none. SERVE-9: a body over the limit is a 413, declared or streamed; unknown
    fields are ignored; after all the refusals the server still answers."""
    ok = json.dumps({"model": "default", "prompt": "x", "max_tokens": 2, "logit_bias": {}, "whatever": 1,
                     "echo": False, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": None,
                     "suffix": None, "response_format": {"type": "text"}})
    for key in (None, "sk-wrong", KEY + "x", KEY[:-1]):
        for path in ("/v1/completions", "/v1/chat/completions"):
            response = server.post(path, ok, key=key)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert server.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 401
    assert server.get("/v1/models", headers={"Authorization": f"Basic {KEY}"}).status_code == 401
    assert server.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    # Every /v1 path asks for the key first, even one that does not exist or a wrong method: 401, not 404 or 405.
    for key, statuses in ((None, (401, 401, 401)), (KEY, (404, 405, 404))):
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        assert (server.get("/v1/nothing", headers=auth).status_code, server.get("/v1/completions", headers=auth)
                .status_code, server.post("/v1", "{}", key=key).status_code) == statuses
    raw = httpx.get(server.url + "/v1/models", headers={b"Authorization": b"Bearer " + KEY.encode() + b"\xe9"})
    assert raw.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert server.get("/health").status_code == 200 and server.get("/metrics").status_code == 200
    big = json.dumps({"model": "default", "prompt": "x" * (1 << 20)})
    response = server.post("/v1/completions", big)
    assert response.status_code == 413 and "limit" in response.json()["error"]["message"]

    def chunked() -> Iterator[bytes]:
        yield b'{"model": "default", "prompt": "'
        for _ in range(20):
            yield b"y" * 65536
        yield b'"}'

    response = httpx.post(server.url + "/v1/completions", content=chunked(), timeout=30,
                          headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 413
    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.client.completions.create(model="default", prompt="x", temperature=-1)
    response = server.post("/v1/completions", ok)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


@pytest.mark.clause("SERVE-13")
def test_metrics_follow_vllm_names(server: Served) -> None:
    """SERVE-13: Prometheus text with vLLM's names under nanoverify:, counters that moved with the work above."""
    server.client.completions.create(model="default", prompt="metrics", max_tokens=3, temperature=0)
    text = server.get("/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "num_preemptions_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "request_success_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket", "check_compared_steps_total", "check_divergences_total"):
        assert f"nanoverify:{name}" in text, name
    assert metric(server, "nanoverify:generation_tokens_total") >= 3
    assert metric(server, 'nanoverify:request_success_total{finished_reason="length"}') >= 1
    assert metric(server, "nanoverify:check_compared_steps_total") > 0
    assert metric(server, "nanoverify:time_to_first_token_seconds_count") >= 1
