"""BI-12: a hypothesis state machine drives one batch-invariant engine as users do (requests arrive between steps,
alone or several at once, some share a prefix, some are aborted; the token budget, the sequence limit, the KV blocks
and the thread count are drawn, few enough blocks that sequences are preempted), and holds every request to its run
alone in a fresh engine: a finished request's tokens and logprobs (generated and prompt, bit for bit) equal it; an
aborted one's are a prefix of it. Its negative control: the same machine with the mode off, driven through a fixed
crowd, finds a difference.

``NANOVERIFY_BI_MACHINE_EXAMPLES=N`` runs N random examples (the suite runs a few, derandomized, so that the
check that they reach every regime cannot flake)."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kernels import cpu_build
from optimized.benchmarks.determinism import Difference, difference
from optimized.engine.engine import EngineStats
from optimized.engine.sampling_params import SamplingParams
from optimized.entry.llm import LLM, RequestOutput
from tests.engine_fixtures import VOCAB, at_threads, checkpoint

pytestmark = [pytest.mark.usefixtures("engine_env"), pytest.mark.clause("BI-12")]

BLOCK = 4
PREFIXES: tuple[list[int], ...] = ([(13 * i + 7) % VOCAB for i in range(12)],
                                   [(29 * i + 3) % VOCAB for i in range(9)], [])
_ALONE: dict[tuple[bool, tuple[int, ...], str], RequestOutput] = {}


def engine(on: bool, **overrides: Any) -> LLM:
    args: dict[str, Any] = {"dtype": "float32", "batch_invariant": on, "kvcache_block_size": BLOCK,
                            "num_kvcache_blocks": 64, **overrides}
    return LLM(str(checkpoint("qwen3")), **args)


def alone(on: bool, prompt: list[int], params: SamplingParams) -> RequestOutput:
    """The request by itself in a fresh engine at one thread (cached by request)."""
    key = (on, tuple(prompt), repr(params))
    if key not in _ALONE:
        with at_threads(1):
            _ALONE[key] = engine(on).generate([prompt], [params], use_tqdm=False)[0]
    return _ALONE[key]


requests = st.tuples(
    st.sampled_from(range(len(PREFIXES))),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),
    st.one_of(st.just(None), st.integers(0, 3)),  # None: greedy; else the seed of a sampled request
    st.integers(1, 8),  # max_tokens
    st.integers(0, 3),  # logprobs
    st.one_of(st.none(), st.integers(0, 3)),  # prompt_logprobs
)


class BatchInvariantMachine(RuleBasedStateMachine):
    """One engine in the mode (``ON``), its requests and what each got."""

    ON = True
    reached: ClassVar[list[EngineStats]] = []  # each run's engine stats, at its end

    def __init__(self) -> None:
        super().__init__()
        self.llm: LLM | None = None
        self.asked: dict[int, tuple[list[int], SamplingParams]] = {}
        self.live: list[int] = []
        self.threads = torch.get_num_threads()

    @initialize(budget=st.sampled_from([5, 8, 16, 64]), seqs=st.integers(1, 8), blocks=st.integers(8, 12),
                threads=st.sampled_from([1, 2]))
    def start(self, budget: int, seqs: int, blocks: int, threads: int) -> None:
        """An engine with this token budget, sequence limit and KV blocks (8 hold the longest request alone: 22
        prompt tokens and 8 generated, in blocks of 4; two long ones do not), at this many threads."""
        torch.set_num_threads(threads)
        self.llm = engine(self.ON, max_num_batched_tokens=budget, max_num_seqs=seqs, num_kvcache_blocks=blocks)

    @rule(request=requests)
    def arrive(self, request: tuple[int, list[int], int | None, int, int, int | None]) -> None:
        """A user sends a request, between two steps: greedy or seeded, maybe behind a shared prefix."""
        assert self.llm is not None
        prefix, tail, seed, max_tokens, logprobs, prompt_logprobs = request
        if seed is None:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs,
                                    prompt_logprobs=prompt_logprobs)
        else:
            params = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=seed, max_tokens=max_tokens,
                                    ignore_eos=True, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        prompt = PREFIXES[prefix] + tail
        rid = self.llm.add_request(prompt, params)
        self.asked[rid] = (prompt, params)
        self.live.append(rid)

    @rule(burst=st.lists(requests, min_size=2, max_size=4))
    def arrive_together(self, burst: list[tuple[int, list[int], int | None, int, int, int | None]]) -> None:
        """Several users send requests at once: they share the next steps, and the KV blocks."""
        for request in burst:
            self.arrive(request)

    @precondition(lambda self: self.live)
    @rule(times=st.integers(1, 4))
    def step(self, times: int) -> None:
        """The engine takes a few steps; whatever finishes is held to its run alone."""
        assert self.llm is not None
        for _ in range(times):
            for out in self.llm.step():
                self.finished(out)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        """A user gives up on a live request: what it got so far is the start of its run alone."""
        self.abort_request(data.draw(st.sampled_from(self.live)))

    def abort_request(self, rid: int) -> None:
        assert self.llm is not None
        out = self.llm.abort(rid)
        self.live.remove(rid)
        assert out is not None and out.finish_reason == "abort"
        whole = alone(self.ON, *self.asked[rid])
        n = len(out.token_ids)
        cut = RequestOutput(whole.request_id, whole.prompt, whole.prompt_token_ids, whole.token_ids[:n], "",
                            "abort", None if whole.logprobs is None else whole.logprobs[:n],
                            None if whole.prompt_logprobs is None or out.prompt_logprobs is None
                            else whole.prompt_logprobs[: len(out.prompt_logprobs)])
        assert difference(cut, out) == Difference(None, None), f"request {rid}, aborted, differs from its run alone"

    def finished(self, out: RequestOutput) -> None:
        self.live.remove(out.request_id)
        assert out.finish_reason == "length"
        found = difference(alone(self.ON, *self.asked[out.request_id]), out)
        assert found == Difference(None, None), f"request {out.request_id} differs from its run alone: {found}"

    @precondition(lambda self: self.live)
    @rule()
    def drain(self) -> None:
        """Everything queued runs to its end."""
        assert self.llm is not None
        while self.llm.has_unfinished_requests():
            for out in self.llm.step():
                self.finished(out)

    @invariant()
    def nothing_lost(self) -> None:
        """The engine holds exactly the requests still live: none lost, finished and aborted ones gone."""
        if self.llm is not None:
            g = self.llm.gauges()
            assert g.running + g.waiting == len(self.live)

    def teardown(self) -> None:
        try:
            if self.llm is not None and self.live:
                self.drain()
        finally:
            torch.set_num_threads(self.threads)
            if self.llm is not None:
                self.reached.append(replace(self.llm.stats))


_EXAMPLES = os.environ.get("NANOVERIFY_BI_MACHINE_EXAMPLES")
SETTINGS = settings(max_examples=int(_EXAMPLES or 6), stateful_step_count=20, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow], derandomize=_EXAMPLES is None, database=None)


@pytest.fixture(autouse=True)
def _kernels_built() -> None:
    if cpu_build.find_compiler() is None:
        pytest.skip("no C compiler on the PATH: the mode is refused")


class ModeOffMachine(BatchInvariantMachine):
    ON = False


def test_every_request_equals_its_run_alone() -> None:
    """BI-12: the machine's runs (a fixed search in the suite, a random one with the environment variable) find no
    request that differs from its run alone, and between them they preempt, chunk prompts, hit the prefix cache and
    abort (with 12 to 24 blocks and one arrival at a time they never preempted)."""
    BatchInvariantMachine.reached.clear()
    run_state_machine_as_test(BatchInvariantMachine, settings=SETTINGS)
    reached = BatchInvariantMachine.reached
    if not SETTINGS.derandomize:
        return  # a random search of any length: what it reached is its own
    assert sum(s.preemptions for s in reached) > 0 and sum(s.chunked_prefills for s in reached) > 0
    assert sum(s.prefix_cache_hit_tokens for s in reached) > 0 and sum(s.aborted_requests for s in reached) > 0


def fixed_crowd(machine: BatchInvariantMachine) -> None:
    """Eight requests (greedy and seeded, four behind shared prefixes), prompts chunked by a budget of 7, 14 KV
    blocks (the crowd preempts), one aborted mid-way, two arriving late, at one thread; then everything drained."""
    machine.start(budget=7, seqs=8, blocks=14, threads=1)
    for i in range(6):
        machine.arrive((i % 3, [(17 * i + j) % VOCAB for j in range(3 + i)], None if i % 3 else i, 8, 2, 2))
    machine.step(3)
    machine.abort_request(machine.live[0])
    for i in range(6, 8):
        machine.arrive((i % 3, [(11 * i + j) % VOCAB for j in range(5)], i, 6, 3, None))
    machine.drain()


def test_a_fixed_crowd_reaches_every_regime_and_holds() -> None:
    """BI-12: the fixed crowd, with the mode on, preempts, chunks, hits the prefix cache and aborts, and every
    request holds to its run alone."""
    machine = BatchInvariantMachine()
    fixed_crowd(machine)
    assert machine.llm is not None
    stats = machine.llm.stats
    assert stats.preemptions > 0 and stats.chunked_prefills > 0 and stats.prefix_cache_hit_tokens > 0
    assert stats.aborted_requests == 1 and not machine.live
    machine.teardown()


def test_with_the_mode_off_the_machine_finds_a_difference() -> None:
    """BI-12's negative control: the same machine with the mode off, through the same fixed crowd, holds some
    request to its run alone and finds its logprobs differ, so the machine can fail."""
    machine = ModeOffMachine()
    with pytest.raises(AssertionError, match="differs from its run alone"):
        fixed_crowd(machine)
    machine.live.clear()  # the rest is not held to anything
    machine.teardown()
