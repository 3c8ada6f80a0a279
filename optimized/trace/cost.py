"""What tracing costs the engine: the same workload served with and without a trace, alternating (TRACE-12).

Invariant: both sides do the same work. Every run serves requests of the same
lengths (greedy, EOS ignored, so every request produces exactly its length)
on the same ``LLM``; each run draws fresh prompt tokens, so no run hits blocks
an earlier run left in the prefix cache; runs alternate in the order
U T T U U T ..., so a drift of the machine's speed falls on both sides alike.
Each side's throughput is the median of its runs. On a shared machine the
runs' spread can exceed the cost itself, so the traced runs also time the
recorder directly (every call the engine makes into it, by a stopwatch around
each): that time over the untraced runs' median time is the cost that no
neighbour's load moves.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from optimized.engine.sampling_params import SamplingParams
from optimized.trace.recorder import Recorder, TraceObserver

ROUNDS = 3  # runs per side
TARGET_PERCENT = 3.0  # TRACE-12: what tracing may cost


def _prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


class TimedObserver:
    """An engine observer wrapped so that every call the engine makes into it is timed (TRACE-12): no global
    is patched, the engine sees one more observer."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds = 0.0

    def __getattr__(self, hook: str) -> Callable[..., Any]:
        call = getattr(self.inner, hook)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def _serve(llm: Any, prompts: list[list[int]], outputs: list[int], trace: Path | None) -> tuple[float, float]:
    """Seconds to serve the requests, recording them in ``trace`` when given; and the seconds spent recording."""
    engine = llm.engine
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    if trace is None:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, 0.0
    recorder = Recorder(trace, engine.scheduler.config, engine.limits.eos_token_ids)
    watch = TimedObserver(TraceObserver(recorder, engine.limits.eos))
    engine.observers.append(watch)
    try:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, watch.seconds
    finally:
        engine.observers.remove(watch)
        recorder.close()


def order(rounds: int) -> list[bool]:
    """Whether each run is traced: U T T U U T ... (each pair mirrors the last)."""
    return [(k % 2 == 1) != (k // 2 % 2 == 1) for k in range(2 * rounds)]


def measure(llm: Any, input_lens: list[int], output_lens: list[int], seed: int, rounds: int = ROUNDS) -> None:
    """Print each run, both sides' median throughput and the cost of tracing."""
    vocab, tokens = llm.engine.limits.vocab_size, sum(output_lens)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    recording: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "bench.trace.jsonl"
        _serve(llm, _prompts(input_lens[:4], vocab, seed - 1), output_lens[:4], trace)  # warm-up, both paths
        _serve(llm, _prompts(input_lens[:4], vocab, seed - 2), output_lens[:4], None)
        for k, traced in enumerate(order(rounds)):
            took, spent = _serve(llm, _prompts(input_lens, vocab, seed + k), output_lens, trace if traced else None)
            seconds[traced].append(took)
            recording += [spent] if traced else []
            size = f", trace {trace.stat().st_size / 1e6:.1f} MB, {spent:.3f} s recording" if traced else ""
            print(f"run {k + 1}: {'traced  ' if traced else 'untraced'} {tokens / took:10.1f} output tok/s "
                  f"({took:.2f} s{size})")
    plain, traced_rate = (tokens / statistics.median(seconds[side]) for side in (False, True))
    own = 100 * statistics.median(recording) / statistics.median(seconds[False])
    print(f"without trace: {plain:10.1f} output tok/s (median of {rounds})")
    print(f"with trace:    {traced_rate:10.1f} output tok/s (median of {rounds})")
    print(f"cost of tracing: {100 * (plain - traced_rate) / plain:+.1f}% by throughput; "
          f"{own:.2f}% by the recorder's own time (target: at most {TARGET_PERCENT:g}%)")
    print(verdict(own))


def verdict(own_percent: float) -> str:
    """The verdict on the recorder's own time (the cost no neighbour's load moves) against the target."""
    within = own_percent <= TARGET_PERCENT
    return (f"verdict: {'within' if within else 'OVER'} the {TARGET_PERCENT:g}% target: the recorder's own time is "
            f"{own_percent:.2f}% of an untraced run")
