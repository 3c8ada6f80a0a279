"""A served run, recorded as it happens, replays identically through both schedulers (TRACE-1, TRACE-6).

One server over two tensor-parallel ranks (TP-1: serve takes ``--tensor-parallel-size``), with ``--trace``: clients
arrive while others run (streamed and whole, one ended by a stop string, one that hangs up), then SIGTERM; the
trace it leaves holds arrivals between steps, aborts and a stop-string end, and ``nanoverify replay`` finds every
step identical on the reference and on the optimized scheduler.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from optimized.cli import main
from tests.test_serve import KEY, Served, spawn, stop


@pytest.fixture(scope="module")
def served_trace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Path]]:
    root = tmp_path_factory.mktemp("serve-trace")
    trace = root / "served.jsonl"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOVERIFY_CACHE", str(root))
        mp.setenv("HOME", str(root))
        served = spawn(["--api-key", KEY, "--dtype", "float64", "--num-kvcache-blocks", "24", "--max-num-seqs", "4",
                        "--tensor-parallel-size", "2", "--trace", str(trace)], root / "server.log")
    try:
        yield served, trace
    finally:
        stop(served)


def _complete(served: Served, i: int) -> str:
    time.sleep(0.05 * i)  # arrivals spread over the run: most land between steps of a running batch
    client = served.client
    if i % 4 == 1:  # streamed
        pieces = [c.choices[0].text for c in client.completions.create(
            model="default", prompt=[1 + i, 2, 3] * 5, max_tokens=12, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if c.choices]
        return "".join(pieces)
    if i % 4 == 2:  # hangs up after two chunks
        stream = client.completions.create(model="default", prompt=[7, 7, i] * 4, max_tokens=40, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        for n, _ in enumerate(stream):
            if n == 2:
                stream.close()
                break
        return ""
    ask = {"model": "default", "prompt": "Hello there " * (1 + i % 3), "max_tokens": 16, "temperature": 0.8,
           "seed": i, "extra_body": {"ignore_eos": True}}
    out = client.completions.create(**ask)  # type: ignore[call-overload]
    if i % 4 == 3:  # again, to stop at a character of that answer (float64: the same tokens, ENG-8)
        text = out.choices[0].text
        stop = next(c for c in text[1:] if c != "\ufffd" and c.isprintable())
        out = client.completions.create(**ask, stop=[stop])  # type: ignore[call-overload]
    return str(out.choices[0].finish_reason)


@pytest.mark.clause("TRACE-1", "TRACE-6", "TP-1")
def test_a_served_run_replays_identically_through_both_schedulers(served_trace: tuple[Served, Path],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    served, trace = served_trace
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: _complete(served, i), range(12)))
    assert "stop" in results  # a stop string ended one
    assert stop(served) == 0  # SIGTERM: a clean exit, the trace flushed and closed
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    arrivals = sorted({r["add"]["arrive"] for r in records if "add" in r})
    assert len(arrivals) > 2  # requests arrived before several different steps: online, not one batch
    assert any("abort" in r for r in records)  # the hang-up and the stop-string end
    steps = sum(1 for r in records if "step" in r)
    assert steps > 10
    for impl in ("reference", "optimized"):
        assert main(["replay", "--impl", impl, str(trace)]) == 0
        assert capsys.readouterr().out.strip().splitlines()[-1] == f"identical: {steps}/{steps} steps"
