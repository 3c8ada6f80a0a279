"""Check mode without an engine: a scheduler port driven through a workload with a ``Shadow`` told of every change,
as the engine tells it (its ``StepObserver`` hooks, in the engine's order), and tokens chosen by a rule instead of a
model. Fast enough to judge a mutant of the optimized core by check mode (tests/test_check_mode_cost.py)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from optimized.core.config import SchedulerConfig
from optimized.core.port import SchedulerPort
from optimized.engine.sampling_params import SamplingParams
from optimized.verify.shadow import Shadow


@dataclass
class Req:
    arrival: int
    seq: Any
    params: SamplingParams
    stop_ids: frozenset[int] = frozenset()
    priority: int = 0


def workload(seed: int, requests: int, vocab: int = 8) -> list[tuple[list[int], int]]:
    """Prompts (half of them opening with a shared prefix, so the prefix cache hits) and max_tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(9)]
    return [((shared if i % 2 else []) + [rng.randrange(vocab) for _ in range(rng.randint(1, 12))],
             rng.randint(1, 10)) for i in range(requests)]


def drive(port: SchedulerPort[Any], shadow: Shadow, work: list[tuple[list[int], int]], eos: int,
          arrive_every: int = 2, abort_every: int = 0, max_steps: int = 400,
          after_postprocess: Callable[[int], None] | None = None,
          priority_of: Callable[[int], int] | None = None) -> int:
    """Admit ``work`` two requests per ``arrive_every`` steps (aborting every ``abort_every``-th arrival one step
    after it came, when set), step until done; tokens are a function of the step and the sequence's length (eos
    now and then). ``after_postprocess(step)``, when given, runs between the port's postprocess and the shadow's
    (a test corrupts the engine's state there). Returns the steps taken; a divergence raises
    ``ShadowDivergence``. ``priority_of(arrival)``, when given, is each request's priority (POLICY-12)."""
    live: dict[int, Req] = {}
    pending = list(enumerate(work))
    step = 0
    to_abort: list[Req] = []
    while (pending or live) and step < max_steps:
        for r in to_abort:
            if r.seq.seq_id in live:
                port.abort(r.seq)
                del live[r.seq.seq_id]
                shadow.aborted(port, r, live)
        to_abort = []
        if step % arrive_every == 0:
            for arrival, (prompt, max_tokens) in pending[:2]:
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
                seq = port.new_sequence(prompt, max_tokens)
                priority = 0 if priority_of is None else priority_of(arrival)
                port.add(seq, priority=priority)
                req = Req(arrival, seq, params, priority=priority)
                live[seq.seq_id] = req
                shadow.added(req)
                if abort_every and arrival % abort_every == abort_every - 1:
                    to_abort.append(req)
            pending = pending[2:]
        if not live:
            step += 1
            continue
        out = port.schedule()
        requests = [live[s.seq_id] for s in out.batch]
        shadow.scheduled(port, out, requests, live)
        tokens = [eos if (step + s.num_tokens) % 11 == 0 else (step * 7 + s.num_tokens) % 5 for s in out.batch]
        finished = [live.pop(s.seq_id) for s in port.postprocess(out.batch, tokens, out.is_prefill)]
        if after_postprocess is not None:
            after_postprocess(step)
        shadow.stepped(port, tokens, finished, 0.0)
        step += 1
    return step


def config(num_blocks: int = 24, block_size: int = 2, max_num_seqs: int = 4, max_num_batched_tokens: int = 16,
           eos: int = 7, policy: str = "lesson", patience: int = 8) -> SchedulerConfig:
    return SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, eos=eos, policy=policy, patience=patience)
