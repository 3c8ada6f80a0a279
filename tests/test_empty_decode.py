"""The empty decode (EDGE-2), the admission rule that removes it (ADMIT-1/2), and liveness (ADMIT-3).

Hypothesis finds the empty decode as soon as requests may break ADMIT-1, and
never finds it when they obey it, under the same fixed, derandomized settings.
The whole-workload properties replay through the normative loop
(optimized/verify/conformance.py) on the reference.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from optimized.core.errors import EmptyDecodeError
from optimized.core.port import SchedulerPort
from optimized.verify.conformance import Request, Workload, implementation, replay
from optimized.verify.machines import Stats, counting
from optimized.verify.machines.reference_machine import Machine, UnadmittedMachine
from optimized.verify.machines.step_contract import can_allocate

EOS = 9
HUNT = settings(max_examples=80, stateful_step_count=30, derandomize=True, database=None, deadline=None,
                phases=[Phase.generate])


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def fits(r: Request, config: dict[str, int]) -> bool:
    """ADMIT-1."""
    return ceil_div(len(r.prompt) + r.max_tokens - 1, config["block_size"]) <= config["num_blocks"]


@pytest.mark.clause("EDGE-2", "DECODE-4", "ADMIT-1")
def test_hypothesis_finds_the_empty_decode_when_requests_may_overflow() -> None:
    """EDGE-2, DECODE-4: without ADMIT-1 the search reaches `assert scheduled_seqs`."""
    stats = Stats()
    with pytest.raises(EmptyDecodeError, match="EDGE-2"):
        run_state_machine_as_test(counting(UnadmittedMachine, stats), settings=HUNT)
    assert stats.violations == 0  # nothing else went wrong on the way


@pytest.mark.clause("ADMIT-1", "ADMIT-2")
def test_hypothesis_never_finds_it_when_requests_obey_the_rule() -> None:
    """ADMIT-1, ADMIT-2: the same search over admitted requests runs clean."""
    stats = Stats()
    run_state_machine_as_test(counting(Machine, stats), settings=HUNT)
    assert stats.steps > 1000 and stats.preemptions > 0  # the search did reach the hard cases


@st.composite
def workloads(draw: st.DrawFn, admitted: bool) -> Workload:
    config = {"block_size": draw(st.integers(2, 8)), "num_blocks": draw(st.integers(1, 6)),
              "max_num_seqs": draw(st.integers(1, 4)), "max_num_batched_tokens": draw(st.integers(1, 16)),
              "eos": EOS}
    capacity = config["block_size"] * config["num_blocks"]
    requests = []
    for i in range(draw(st.integers(1, 6))):
        # footprint = len(prompt) + max_tokens - 1, the KV tokens a request holds at its longest
        footprint = draw(st.integers(1, min(capacity if admitted else 2 * capacity, 32)))
        prompt = draw(st.lists(st.integers(1, 3), min_size=1, max_size=footprint))
        max_tokens = footprint - len(prompt) + 1
        output = draw(st.lists(st.integers(1, EOS), min_size=max_tokens, max_size=max_tokens))
        requests.append(Request(i, prompt, max_tokens, draw(st.booleans()), draw(st.integers(0, 8)), output))
    return Workload(config, requests)


class Runaway(Exception):
    """More steps than the a-priori bound of ADMIT-3: the run is not live."""


def replay_bounded(workload: Workload) -> list[dict[str, Any]]:
    """Replay, aborting once the a-priori step bound (preemptions at their worst) is passed."""
    c, rs = workload.config, workload.requests
    total = sum(r.max_tokens for r in rs)
    longest = max(ceil_div(len(r.prompt) + r.max_tokens - 1, c["max_num_batched_tokens"]) for r in rs)
    cap = sum(r.max_tokens + ceil_div(len(r.prompt), c["max_num_batched_tokens"]) for r in rs)
    cap += (len(rs) - 1) * total * longest
    steps = 0

    def count(*_: Any) -> None:
        nonlocal steps
        steps += 1
        if steps > cap:
            raise Runaway(f"{steps} steps > {cap}")

    return replay(workload, implementation("reference"), on_schedule=count)


@pytest.mark.clause("ADMIT-2", "EDGE-2")
@given(workloads(admitted=False))
def test_every_empty_decode_comes_from_a_request_breaking_the_rule(workload: Workload) -> None:
    """ADMIT-2, EDGE-2: a trace that ends in the empty decode has a request with ceil((P + M - 1)/bs) > num_blocks.

    Every example asserts it, in the form: when all requests fit, no empty decode.
    """
    all_fit = all(fits(r, workload.config) for r in workload.requests)
    empty_decode = replay_bounded(workload)[-1].get("error") == "empty decode"
    assert not (all_fit and empty_decode)


def ends_in_empty_decode(workload: Workload) -> bool:
    return replay_bounded(workload)[-1].get("error") == "empty decode"


@pytest.mark.clause("EDGE-2", "ADMIT-2", "ADMIT-1")
def test_find_returns_a_minimal_workload_that_empties_the_decode() -> None:
    """EDGE-2, ADMIT-2: hypothesis' find() reaches the empty decode, and its minimal workload breaks ADMIT-1."""
    workload = find(workloads(admitted=False), ends_in_empty_decode,
                    settings=settings(max_examples=500, derandomize=True, database=None))
    assert len(workload.requests) == 1  # one request suffices: it alone outgrows the cache
    assert not fits(workload.requests[0], workload.config)


@pytest.mark.clause("ADMIT-3", "ADMIT-2")
@given(workloads(admitted=True))
def test_admitted_workloads_finish_within_the_liveness_bound(workload: Workload) -> None:
    """ADMIT-3: steps <= sum(M + ceil(P/B)) + sum over preemptions of ceil((P + M - 1)/B); ADMIT-2: no empty decode."""
    trace = replay_bounded(workload)
    assert all("error" not in record for record in trace)
    c = workload.config
    by_id = {r.id: r for r in workload.requests}
    bound = sum(r.max_tokens + ceil_div(len(r.prompt), c["max_num_batched_tokens"]) for r in workload.requests)
    for record in trace:
        for rid in record["preempted"]:
            r = by_id[rid]
            bound += ceil_div(len(r.prompt) + r.max_tokens - 1, c["max_num_batched_tokens"])
    assert len(trace) <= bound
    finished = [rid for record in trace for rid in record["finished"]]
    assert sorted(finished) == sorted(by_id)  # everyone finished, once


@pytest.mark.clause("KNOB-3")
@given(workloads(admitted=True))
def test_a_cache_that_holds_everyone_never_preempts(workload: Workload) -> None:
    """KNOB-3: with num_blocks >= the sum of all footprints, nothing waits for blocks."""
    c = dict(workload.config)
    c["num_blocks"] = sum(ceil_div(len(r.prompt) + r.max_tokens - 1, c["block_size"]) for r in workload.requests)
    roomy = Workload(c, workload.requests)

    def every_waiting_sequence_fits(port: SchedulerPort[Any], *_: Any) -> None:
        state = port.snapshot()
        for seq in state.waiting:
            if not seq.block_table:
                assert can_allocate(state, seq.token_ids) != -1

    trace = replay(roomy, implementation("reference"), on_postprocess=every_waiting_sequence_fits)
    assert not any(record.get("preempted") for record in trace)
