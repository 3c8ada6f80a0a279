"""The server under a scheduling policy (spec/policies.md, POLICY-11, POLICY-12; spec/serve.md): the real ``openai``
client sends ``priority`` as vLLM's extra body field, on completions and chat.

One spawned server (``--scheduling-policy priority``, one sequence a step, float64, the default model) and its
offline oracle; the refusal under the lesson's policy needs a server of that policy, and takes the app in process
on an offline engine (tests/test_serve_lifecycle.py's ``InProcess``), no second spawn.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from optimized import LLM, SamplingParams
from tests.test_serve import KEY, Served, spawn, stop
from tests.test_serve_lifecycle import InProcess

BLOCKS = 128
RENDERED = "<|user|>\nHi\n<|assistant|>\n"  # the default model's chat template on one user message "Hi"


@pytest.fixture(scope="module")
def offline(serve_cache: Path) -> LLM:
    """The default model under the priority policy, as the server runs it (the model is made here, first)."""
    return LLM(None, dtype="float64", num_kvcache_blocks=BLOCKS, scheduling_policy="priority", max_num_seqs=1)


@pytest.fixture(scope="module")
def server(offline: LLM, serve_cache: Path) -> Iterator[Served]:
    served = spawn(["--dtype", "float64", "--api-key", KEY, "--num-kvcache-blocks", str(BLOCKS),
                    "--scheduling-policy", "priority", "--max-num-seqs", "1"], serve_cache / "server.log")
    try:
        yield served
    finally:
        stop(served)


def completion(client: openai.OpenAI, prompt: str, max_tokens: int, priority: object, **extra: Any) -> Any:
    return client.completions.create(model="default", prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                     extra_body={"priority": priority, "ignore_eos": True, "return_token_ids": True},
                                     **extra)


def chat(client: openai.OpenAI, max_tokens: int, priority: object) -> Any:
    return client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=max_tokens, temperature=0.0,
                                          extra_body={"priority": priority, "ignore_eos": True})


def refused(call: Any) -> dict[str, Any]:
    """The OpenAI error of a call that must be a 400."""
    with pytest.raises(openai.BadRequestError) as error:
        call()
    assert error.value.status_code == 400
    body = error.value.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
    return body  # type: ignore[no-any-return]


# The body's shape refuses what is no JSON integer (protocol.py, strict); the one validator what is past int64.
NOT_INT = "priority: Input should be a valid integer"
BAD = [(True, NOT_INT), (1.5, NOT_INT), ("1", NOT_INT),
       (1 << 63, "priority: must be an int64 (in [-2**63, 2**63 - 1]), got 9223372036854775808"),
       (-(1 << 63) - 1, "priority: must be an int64")]


@pytest.mark.clause("POLICY-11", "POLICY-12", "SERVE-1")
def test_priority_reaches_the_engine_on_both_endpoints(server: Served, offline: LLM) -> None:
    """POLICY-11, POLICY-12: a server started with --scheduling-policy priority takes ``priority`` (the extremes of
    int64 too) from the real client's extra body on completions and chat, and answers what the offline engine of
    the same policy does."""
    client = server.client
    want = offline.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), False,
                            priority=[-7])[0]
    for priority in (-7, 0, 12, -(1 << 63), (1 << 63) - 1):
        got = completion(client, "Hello", 6, priority)
        assert got.choices[0].model_extra["token_ids"] == want.token_ids and got.choices[0].text == want.text
    want = offline.generate([RENDERED], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), False)[0]
    assert chat(client, 5, -3).choices[0].message.content == want.text


@pytest.mark.clause("POLICY-12", "SERVE-9")
def test_a_bad_priority_is_a_400_naming_it(server: Served) -> None:
    """POLICY-12: a priority that is no int (a bool, a float, a string) or outside int64 is a 400 whose param is
    ``priority``, on both endpoints; the server keeps serving."""
    client = server.client
    for bad, words in BAD:
        for call in (lambda bad=bad: completion(client, "Hi", 2, bad), lambda bad=bad: chat(client, 2, bad)):
            error = refused(call)
            assert error["param"] == "priority" and error["message"].startswith(words), error
    assert completion(client, "Hi", 2, 0).choices[0].finish_reason == "length"


def _finish_order(client: openai.OpenAI, priorities: tuple[int, int, int]) -> list[str]:
    """A long request streams; while it runs, two short ones come (B first, then C), with ``priorities`` for A, B
    and C: the order their answers end in."""
    ended: list[str] = []
    lock = threading.Lock()

    def short(name: str, priority: int) -> None:
        completion(client, f"Request {name}", 3, priority)
        with lock:
            ended.append(name)

    stream = completion(client, "A long one", 400, priorities[0], stream=True)
    next(iter(stream))  # A runs
    b = threading.Thread(target=short, args=("B", priorities[1]))
    b.start()
    time.sleep(0.3)  # B is admitted before C arrives
    c = threading.Thread(target=short, args=("C", priorities[2]))
    c.start()
    for _ in stream:
        pass
    with lock:
        ended.append("A")
    b.join(60)
    c.join(60)
    return ended


@pytest.mark.clause("POLICY-12")
def test_a_more_urgent_request_overtakes_over_http(server: Served) -> None:
    """POLICY-12 end to end: at one sequence a step the most urgent running request decodes first, so C (priority
    -5), arriving last, ends before the long A (0), and B (5), arriving before C, ends after A. The control: with
    equal priorities the long A, first to arrive, ends first."""
    assert _finish_order(server.client, (0, 5, -5)) == ["C", "A", "B"]
    assert _finish_order(server.client, (0, 0, 0)) == ["A", "B", "C"]


@pytest.mark.clause("POLICY-12", "SERVE-9")
def test_under_the_lesson_a_priority_is_refused_by_the_server(serve_cache: Path) -> None:
    """POLICY-12: a server whose policy is not ``priority`` answers a priority other than 0 with a 400 naming
    ``priority`` and saying the scheduling policy, on both endpoints (as vLLM refuses it); 0 is taken; a priority
    that is no int is a 400 naming it all the same."""
    llm = LLM(None, dtype="float32", num_kvcache_blocks=32)
    served = InProcess(llm)
    try:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60)
        for call in (lambda: completion(client, "Hi", 2, 4), lambda: chat(client, 2, -1)):
            error = refused(call)
            assert error["param"] == "priority" and "scheduling_policy 'priority'" in error["message"], error
            assert "this engine's is 'lesson'" in error["message"], error
        error = refused(lambda: completion(client, "Hi", 2, 1 << 63))
        assert error["param"] == "priority" and error["message"].startswith(BAD[3][1]), error
        error = refused(lambda: completion(client, "Hi", 2, 3, stream=True))  # a stream refused before it starts
        assert error["param"] == "priority", error
        loop = served.loop
        assert llm.engine._arrivals == 0 and not (loop._arrivals or loop._live or loop._unscheduled)  # none leaked
        assert completion(client, "Hi", 2, 0).choices[0].finish_reason == "length"
        assert chat(client, 2, 0).choices[0].finish_reason == "length"
    finally:
        served.close()
