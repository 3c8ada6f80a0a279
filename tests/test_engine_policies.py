"""The engine under every scheduling policy (spec/policies.md): the setting (POLICY-11), each request's priority
(POLICY-12), and the engine's output token-exact against transformers and batch-invariant under every policy
(POLICY-17), on workloads where each policy's own decisions happen (counted, with the lesson as the control)."""

from __future__ import annotations

import argparse
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kernels import cpu_build
from optimized import LLM, SamplingParams
from optimized.cli import main
from optimized.cli.command import build_parser
from optimized.core.config import DEFAULT_PATIENCE, POLICIES
from optimized.core.policies import scheduler_class
from optimized.engine.args import EngineArgs, knob_of
from optimized.engine.model_runner import DrawParams, ModelRunner
from optimized.engine.sampling_params import Logprob
from optimized.engine.validation import RequestRefused
from tests.engine_fixtures import VOCAB, checkpoint, hf_greedy

pytestmark = pytest.mark.usefixtures("engine_env")
ENGINE_COMMANDS = (["run"], ["generate", "hi"], ["serve"], ["bench", "throughput"], ["bench", "serve"])


# --- POLICY-11: the setting ------------------------------------------------------------------------------------


def _help(words: list[str]) -> str:
    parser: argparse.ArgumentParser = build_parser()
    for word in words:
        if word == "hi":
            break
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = subparsers.choices[word]
    return " ".join(parser.format_help().split())  # argparse wraps the help: one line to search


@pytest.mark.clause("POLICY-11")
def test_the_policy_and_lpm_patience_are_engine_args_fields() -> None:
    """POLICY-11: ``scheduling_policy`` (one of lesson, mixed, priority, lpm; default lesson) and ``lpm_patience`` (an
    int >= 0, default 8) are EngineArgs fields, refused otherwise by name, carried into the scheduler's config as
    its policy and patience; the policy's help names each policy."""
    assert EngineArgs().scheduling_policy == "lesson" and EngineArgs().lpm_patience == DEFAULT_PATIENCE == 8
    assert knob_of("scheduling_policy").choices == POLICIES == ("lesson", "mixed", "priority", "lpm")
    assert all(f"{policy} (" in knob_of("scheduling_policy").help for policy in POLICIES)
    for policy in POLICIES:
        config = EngineArgs(scheduling_policy=policy, lpm_patience=3).scheduler_config(num_blocks=9, eos=5)
        assert (config.policy, config.patience, config.num_blocks, config.eos) == (policy, 3, 9, 5)
    assert EngineArgs(lpm_patience=0).scheduler_config(9, 5).patience == 0
    bad: object
    for bad in ("fifo", "", None, 1, "Lesson"):
        with pytest.raises(ValueError, match=r"^scheduling_policy must be one of \['lesson', 'mixed', 'priority', "):
            EngineArgs(scheduling_policy=bad)  # type: ignore[arg-type]
    for bad in (-1, True, 1.0, "8", None):
        with pytest.raises(ValueError, match=r"^lpm_patience must be an integer >= 0, got "):
            EngineArgs(lpm_patience=bad)  # type: ignore[arg-type]
    assert EngineArgs(scheduling_policy="lpm", lpm_patience=2).cli_flags() == [
        "--scheduling-policy", "lpm", "--lpm-patience", "2"]


@pytest.mark.clause("POLICY-11", "CLI-2")
@pytest.mark.parametrize("words", ENGINE_COMMANDS, ids=" ".join)
def test_every_engine_command_takes_the_policy_flags(words: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """POLICY-11, CLI-2: every command that builds an engine shows --scheduling-policy (its four choices) and
    --lpm-patience in its help with their defaults and parses them into EngineArgs; a bad value is one line on
    standard error naming the flag, and exit 2, before anything loads."""
    text = _help(words)
    assert "--scheduling-policy {lesson,mixed,priority,lpm}" in text and "(default: lesson)" in text
    assert "--lpm-patience N" in text and "passed over before it is due (0: the lesson's order) (default: 8)" in text
    given = build_parser().parse_args([*words, "--scheduling-policy", "mixed", "--lpm-patience", "0"])
    args = EngineArgs.from_cli_args(given)
    assert (args.scheduling_policy, args.lpm_patience) == ("mixed", 0)
    command = " ".join(w for w in words if w != "hi")
    for flag, value, words_of_error in (("--scheduling-policy", "fifo", "invalid choice: 'fifo'"),
                                        ("--lpm-patience", "-1", "must be an integer in [0, "),
                                        ("--lpm-patience", "x", "must be an integer in [0, ")):
        assert main([*words, flag, value]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, err
        assert err.startswith(f"nanoverify {command}: argument {flag}: {words_of_error}"), err


@pytest.mark.clause("POLICY-11", "ENG-17")
@pytest.mark.parametrize("policy", POLICIES)
def test_the_engine_runs_the_policys_scheduler(policy: str) -> None:
    """POLICY-11: ``LLM(scheduling_policy=...)`` makes the engine's scheduler the optimized class of that policy
    (optimized/core/policies.py), with the patience given; ``LLM.settings`` shows both."""
    llm = LLM(str(checkpoint("qwen3")), dtype="float64", kvcache_block_size=4, num_kvcache_blocks=16,
              scheduling_policy=policy, lpm_patience=5)
    assert (llm.settings.scheduling_policy, llm.settings.lpm_patience) == (policy, 5)
    assert type(llm.engine.scheduler) is scheduler_class(policy)
    config = llm.engine.scheduler.config
    assert (config.policy, config.patience) == (policy, 5)
    assert llm.limits.scheduling_policy == policy
    assert LLM(str(checkpoint("qwen3")), num_kvcache_blocks=8).settings.scheduling_policy == "lesson"


@pytest.mark.clause("POLICY-11", "ENG-24")
@pytest.mark.parametrize(("policy", "shown"), [("lesson", "lesson"), ("mixed", "mixed"), ("lpm", "lpm (patience 2)")])
def test_run_says_its_policy_and_its_mixed_steps(policy: str, shown: str, capsys: pytest.CaptureFixture[str]) -> None:
    """POLICY-11, ENG-24: ``nanoverify run --scheduling-policy P`` runs P and says so (lpm with its patience); its
    steps line counts the prefill steps that also decoded, under mixed only (the lesson's control: none)."""
    assert main(["run", "--model", str(checkpoint("qwen3")), "--no-check", "--scheduling-policy", policy,
                 "--lpm-patience", "2", "--num-requests", "12", "--max-input-len", "40", "--max-output-len", "8",
                 "--max-num-batched-tokens", "16", "--num-kvcache-blocks", "64", "--block-size", "4"]) == 0
    out = capsys.readouterr().out
    assert f"scheduling policy: {shown}\n" in out
    steps = next(line for line in out.splitlines() if line.startswith("steps: "))
    assert ("of them mixed with decodes" in steps) is (policy == "mixed"), steps


# --- POLICY-12: a request's priority ---------------------------------------------------------------------------


def _engine(policy: str = "lesson", **overrides: Any) -> LLM:
    args: dict[str, Any] = {"dtype": "float64", "kvcache_block_size": 4, "num_kvcache_blocks": 32,
                            "scheduling_policy": policy, **overrides}
    return LLM(str(checkpoint("qwen3")), **args)


def _nothing_added(llm: LLM) -> bool:
    return not llm.has_unfinished_requests() and llm.engine._arrivals == 0


@pytest.mark.clause("POLICY-12", "ENG-10")
@pytest.mark.parametrize("policy", ["lesson", "mixed", "lpm"])
def test_a_priority_other_than_0_is_refused_unless_the_policy_is_priority(policy: str) -> None:
    """POLICY-12: under lesson, mixed and lpm a priority other than 0, through generate's list or add_request's
    argument, is a RequestRefused naming ``priority`` and ``scheduling_policy``, nothing added; 0 (an int of any
    integer type, a numpy one too) is taken."""
    llm = _engine(policy)
    prompts = [[1, 2, 3], [4, 5]]
    for call in (lambda: llm.generate(prompts, SamplingParams(max_tokens=2), False, priority=[0, 1]),
                 lambda: llm.add_request([1, 2], SamplingParams(max_tokens=2), priority=-1)):
        with pytest.raises(RequestRefused, match=r"priority is -?1, but only scheduling_policy 'priority' orders "
                           rf"requests by priority \(this engine's is '{policy}'\)") as refused:
            call()
        assert refused.value.field == "priority"
        assert _nothing_added(llm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=2), False, priority=[0, np.int64(0)])  # type: ignore[list-item]
    assert [len(o.token_ids) for o in outs] == [2, 2]
    assert llm.add_request([1, 2], SamplingParams(max_tokens=1), priority=0) == 2


@pytest.mark.clause("POLICY-12", "ENG-10")
@pytest.mark.parametrize("policy", ["lesson", "priority"])
def test_a_priority_that_is_no_int64_is_refused_under_any_policy(policy: str) -> None:
    """POLICY-12: a priority that is not an int (a bool, a float, a string, None) or is outside int64, or a
    priority list that is not a list or not one per prompt, is a RequestRefused naming ``priority``; nothing is
    added. Under ``priority`` the extremes of int64 are taken."""
    llm = _engine(policy)
    for bad, words in ((True, "must be an int, got True"), (1.0, "must be an int, got 1.0"),
                       ("1", "must be an int, got '1'"), (None, "must be an int, got None"),
                       (1 << 63, r"must be an int64 \(in \[-2\*\*63, 2\*\*63 - 1\]\), got 9223372036854775808"),
                       (-(1 << 63) - 1, "must be an int64")):
        with pytest.raises(RequestRefused, match=f"priority {words}") as refused:
            llm.add_request([1, 2], SamplingParams(max_tokens=2), priority=bad)  # type: ignore[arg-type]
        assert refused.value.field == "priority"
        with pytest.raises(RequestRefused, match=f"prompt 1: priority {words}"):
            llm.generate([[1], [2]], SamplingParams(max_tokens=2), False, priority=[0, bad])  # type: ignore[list-item]
        assert _nothing_added(llm)
        good = [0, 0, 0] if policy == "lesson" else [4, -1, 0]  # the last prompt's refusal, after three good ones
        with pytest.raises(RequestRefused, match=f"prompt 3: priority {words}"):
            llm.generate([[1], [2], [3], [4]], SamplingParams(max_tokens=2), False, priority=[*good, bad])  # type: ignore[list-item]
        assert _nothing_added(llm)
    for bad_list, words in (([0], r"priority: 1 given for 2 prompts"), ([0, 0, 0], r"priority: 3 given for 2"),
                            (0, r"priority must be a list of ints, one per prompt, got int"),
                            ("00", r"priority must be a list of ints, one per prompt, got str")):
        with pytest.raises(RequestRefused, match=words) as refused:
            llm.generate([[1], [2]], SamplingParams(max_tokens=2), False, priority=bad_list)  # type: ignore[arg-type]
        assert refused.value.field == "priority"
        assert _nothing_added(llm)
    with pytest.raises(RequestRefused, match="priority must be an int"):
        llm.engine.add([1, 2], SamplingParams(max_tokens=2), seed=0, priority=False)  # the engine's own add too
    assert _nothing_added(llm)
    if policy == "priority":
        outs = llm.generate([[1], [2]], SamplingParams(max_tokens=2), False, priority=[-(1 << 63), (1 << 63) - 1])
        assert [len(o.token_ids) for o in outs] == [2, 2]


@pytest.mark.clause("POLICY-12")
def test_priority_orders_requests_and_equal_priorities_keep_arrival_order() -> None:
    """POLICY-12: under ``priority`` with one sequence a step, requests finish in (priority, arrival) order
    whatever their arrival, through add_request and generate; the request keeps its priority on the engine's
    Request and the scheduler's snapshot. The control: equal priorities finish in arrival order."""
    llm = _engine("priority", max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=3)
    ids = [llm.add_request([7 + i, 9], params, priority=p) for i, p in enumerate((5, -2, 0, -2))]
    assert [r.priority for r in llm.engine.by_arrival.values()] == [5, -2, 0, -2]
    assert sorted(llm.engine.scheduler.snapshot().priorities.values()) == [-2, -2, 0, 5]
    order: list[int] = []
    while llm.has_unfinished_requests():
        order += [o.request_id for o in llm.step()]
    assert order == [ids[1], ids[3], ids[2], ids[0]]
    equal = [llm.add_request([7 + i, 9], params, priority=3) for i in range(3)]
    order = []
    while llm.has_unfinished_requests():
        order += [o.request_id for o in llm.step()]
    assert order == equal


# --- POLICY-17: token-exact under every policy -----------------------------------------------------------------


@dataclass
class Watch:
    """A ``StepObserver`` that notes what each step decided: the order requests first ran in, the steps whose
    batch held decodes and prefill chunks at once, and the most any waiting request was passed over (lpm)."""

    first_ran: list[int] = field(default_factory=list)
    mixed_steps: int = 0
    most_passes: int = 0

    def before_change(self) -> None: ...

    def check_add(self, token_ids: Sequence[int], params: SamplingParams) -> None: ...

    def added(self, request: Any) -> None: ...

    def scheduled(self, scheduler: Any, out: Any, requests: Sequence[Any], live: Mapping[int, Any]) -> None:
        self.first_ran += [r.arrival for r in requests if r.arrival not in self.first_ran]
        kinds = {s.is_prefill for s in out.batch}
        assert out.is_prefill or kinds == {False}  # a decode step decodes only
        self.mixed_steps += out.is_prefill and kinds == {True, False}

    def stepped(self, scheduler: Any, tokens: Any, finished: Sequence[Any], start: float) -> None:
        self.most_passes = max([self.most_passes, *scheduler.snapshot().passes.values()])

    def step_failed(self, fault: BaseException, start: float) -> None: ...

    def batch_withdrawn(self, scheduler: Any, failed: Sequence[Any], live: Mapping[int, Any]) -> None: ...

    def aborted(self, scheduler: Any, request: Any, live: Mapping[int, Any]) -> None: ...

    def close(self) -> None: ...

    @property
    def reordered(self) -> bool:
        """Some request ran for the first time before one that arrived earlier."""
        return self.first_ran != sorted(self.first_ran)


def workload(seed: int = 11) -> tuple[list[list[int]], list[int], list[int]]:
    """Prompts (four share a 16-token prefix, four stand alone, interleaved; some longer than the token budget),
    their max_tokens, and priorities that reverse much of the arrival order."""
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(16)]

    def fresh(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    prompts = [prefix + fresh(3), fresh(30), fresh(9), prefix + fresh(5), fresh(21), prefix + fresh(2), fresh(5),
               prefix + fresh(7)]
    max_tokens = [6 + (5 * i) % 9 for i in range(len(prompts))]
    priorities = [3, 2, 2, 0, 3, -1, 1, 0]
    return prompts, max_tokens, priorities


PROMPTS, MAX_TOKENS, PRIORITIES = workload()
# A budget of 16 tokens (prompts chunk, and mixed steps hold decodes beside prefill chunks), 3 sequences a step
# (the waiting queue is long enough to reorder), 4-token blocks; TIGHT blocks preempt, ROOMY do not.
COMMON: dict[str, Any] = {"kvcache_block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 3}
TIGHT, ROOMY = 14, 96


def run_policy(policy: str, blocks: int, **extra: Any) -> tuple[LLM, Watch, list[list[int]]]:
    """The workload, greedy in float64 under ``policy`` (priorities only under ``priority``); what it decided."""
    llm = LLM(str(checkpoint("qwen3")), dtype="float64", device="cpu", num_kvcache_blocks=blocks,
              scheduling_policy=policy, **{**COMMON, **extra})
    watch = Watch()
    llm.engine.observers.append(watch)
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params, False, priority=PRIORITIES if policy == "priority" else None)
    return llm, watch, [o.token_ids for o in outs]


@pytest.mark.clause("POLICY-17")
@pytest.mark.parametrize("blocks", [ROOMY, TIGHT], ids=["roomy", "tight"])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_is_transformers_under_every_policy(policy: str, blocks: int) -> None:
    """POLICY-17: under each policy, with a roomy cache and one so small that it preempts, the float64 greedy
    output of every request is transformers' token for token, on a workload where the policy's own decisions
    happen: mixed steps holding decodes and prefill chunks (mixed), requests run out of arrival order by priority
    (priority) or by cached prefix (lpm), and prefix-cache hits, chunked prefills and (tight) preemptions under
    all. The lesson is the control: it never mixes a step and runs requests in arrival order, as mixed does."""
    llm, watch, got = run_policy(policy, blocks)
    assert got == hf_greedy(checkpoint("qwen3"), PROMPTS, MAX_TOKENS)
    stats = llm.stats
    assert stats.prefix_cache_hit_tokens > 0 and stats.chunked_prefills > 0
    assert (stats.preemptions > 0) is (blocks == TIGHT), stats
    assert stats.mixed_steps == watch.mixed_steps
    assert (watch.mixed_steps > 0) is (policy == "mixed"), watch
    assert stats.mixed_decode_tokens >= stats.mixed_steps
    if blocks == ROOMY:  # a preemption puts a request back in line, which lets even the lesson run one out of order
        assert watch.reordered is (policy in ("priority", "lpm")), watch.first_ran


@pytest.mark.clause("POLICY-16", "POLICY-17")
@pytest.mark.parametrize("policy", POLICIES)
def test_check_mode_shadows_every_policy_on_the_engine(policy: str) -> None:
    """POLICY-16, POLICY-17: with check mode on, the same preempting workload under each policy has every step
    compared with that policy's reference (priorities mirrored too), and its output is still transformers'."""
    llm, _, got = run_policy(policy, TIGHT, check=True)
    assert got == hf_greedy(checkpoint("qwen3"), PROMPTS, MAX_TOKENS)
    assert llm.stats.compared_steps == llm.stats.steps > 0 and llm.stats.preemptions > 0


@pytest.mark.clause("POLICY-17")
def test_lpm_passed_over_requests_become_due_and_output_stays_exact() -> None:
    """POLICY-17 with lpm's starvation bound at work: at patience 1 some waiting request is passed over (and so
    due), never more than once, and the output is still transformers'."""
    _, watch, got = run_policy("lpm", ROOMY, lpm_patience=1)
    assert got == hf_greedy(checkpoint("qwen3"), PROMPTS, MAX_TOKENS)
    assert watch.most_passes == 1 and watch.reordered


@pytest.mark.clause("POLICY-17")
@pytest.mark.parametrize("policy", POLICIES)
def test_logprobs_and_prompt_logprobs_under_every_policy(policy: str) -> None:
    """POLICY-17: the logprobs of each generated token and of each prompt token are those of the same request
    run alone (float64, to 1e-9: the model in another batch shape), and each prompt's come whole, under every
    policy with the tight cache (chunks, mixed steps, preemption and prefix-cache hits in one run)."""
    llm = LLM(str(checkpoint("qwen3")), dtype="float64", device="cpu", num_kvcache_blocks=TIGHT,
              scheduling_policy=policy, **COMMON)
    params = [SamplingParams(temperature=0.0, max_tokens=m, logprobs=2, prompt_logprobs=1) for m in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params, False, priority=PRIORITIES if policy == "priority" else None)
    alone = LLM(str(checkpoint("qwen3")), dtype="float64", device="cpu", num_kvcache_blocks=ROOMY,
                kvcache_block_size=4)
    for prompt, sp, out in zip(PROMPTS, params, outs, strict=True):
        want = alone.generate([prompt], sp, False)[0]
        assert out.token_ids == want.token_ids
        assert out.logprobs is not None and out.prompt_logprobs is not None
        assert want.logprobs is not None and want.prompt_logprobs is not None
        assert len(out.logprobs) == len(out.token_ids) and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        for got_row, want_row in zip(out.logprobs + out.prompt_logprobs[1:], want.logprobs + want.prompt_logprobs[1:],
                                     strict=True):
            assert got_row is not None and want_row is not None
            assert {t: lp.rank for t, lp in got_row.items()} == {t: lp.rank for t, lp in want_row.items()}
            assert all(abs(got_row[t].logprob - want_row[t].logprob) < 1e-9 for t in got_row)
    assert llm.stats.preemptions > 0 and llm.stats.prefix_cache_hit_tokens > 0


# --- a mixed step is a prefill step to the runner ----------------------------------------------------------------


@dataclass
class FakeSeq:
    """What the runner reads of a scheduled sequence (``ScheduledSeq``), set by hand: a scheduler-free step."""

    seq_id: int
    tokens: list[int]
    num_prompt_tokens: int
    block_table: list[int]
    num_cached_tokens: int
    num_scheduled_tokens: int

    def stored_tokens(self) -> npt.NDArray[np.int64]:
        return np.asarray(self.tokens, dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def last_token(self) -> int:
        return self.tokens[-1]


def _greedy_draw(logprobs: int = -1, prompt_logprobs: int = -1) -> DrawParams:
    return DrawParams(0.0, -1, 1.0, 0, logprobs, prompt_logprobs)


def _mixed_run(runner: ModelRunner, a: list[int], b: list[int], mixed: bool) -> tuple[list[int], dict[int, Any]]:
    """Request a (6 tokens) prefilled, then a decode of a beside b's first chunk of 5 and its last of 2: in one
    prefill step each (``mixed``), or the decode and the chunk in steps of their own. The drawn tokens (a's two
    decodes, b's first) and the logprobs of the steps that held b."""
    first = FakeSeq(1, list(a), len(a), [0, 1], 0, len(a))
    tokens = runner.run([first], True, [_greedy_draw()])
    first.tokens.append(tokens[0])
    first.num_cached_tokens, first.num_scheduled_tokens = len(a), 1
    second = FakeSeq(2, list(b), len(b), [4, 5], 0, 5)
    got = [tokens[0]]
    logprobs: dict[int, Any] = {}
    for chunk in (5, 2):
        second.num_scheduled_tokens = chunk
        # b's prompt logprobs from the first position its earlier chunks did not cover, as the engine asks (ENG-20)
        draws = [_greedy_draw(logprobs=2), replace(_greedy_draw(2, 2), prompt_from=second.num_cached_tokens)]
        if mixed:
            drawn = runner.run([first, second], True, draws)
            step = runner.take_logprobs()
        else:
            drawn = runner.run([first], False, draws[:1])
            step = runner.take_logprobs()
            drawn += runner.run([second], True, draws[1:])
            step = {**step, **runner.take_logprobs()}
        for seq_id, lp in step.items():
            logprobs.setdefault(seq_id, []).append(lp)
        first.tokens.append(drawn[0])
        first.num_cached_tokens += 1
        second.num_cached_tokens += chunk
        got.append(drawn[0])
        if chunk == 2:
            got.append(drawn[1])
    return got, logprobs


@pytest.mark.clause("POLICY-17")
def test_a_step_of_decodes_and_prefill_chunks_is_one_prefill_step_to_the_runner() -> None:
    """POLICY-17 at the runner, with no scheduler: a decode in a prefill step (its one token a chunk from its
    cached length) beside another sequence's prefill chunks draws transformers' tokens in float64, and b's token
    after its last chunk is transformers' too; in the batch-invariant mode the decode's logprobs and b's prompt
    logprobs are the same bits in one mixed step as in steps of their own."""
    a, b = [11, 3, 250, 7, 19, 42], [5, 99, 123, 8, 77, 200, 31]
    llm = LLM(str(checkpoint("qwen3")), dtype="float64", device="cpu", num_kvcache_blocks=8, kvcache_block_size=4)
    got, _ = _mixed_run(llm.engine.runner, a, b, mixed=True)
    want_a = hf_greedy(checkpoint("qwen3"), [a], [3])[0]
    want_b = hf_greedy(checkpoint("qwen3"), [b], [1])[0]
    assert got[:3] == want_a and got[3:] == want_b
    if cpu_build.find_compiler() is None:
        return  # the batch-invariant mode needs the C kernels
    bits = []
    for mixed in (True, False):
        runner = LLM(str(checkpoint("qwen3")), dtype="float32", batch_invariant=True, num_kvcache_blocks=8,
                     kvcache_block_size=4).engine.runner
        tokens, logprobs = _mixed_run(runner, a, b, mixed)
        bits.append((tokens, _logprob_bits(logprobs)))
    assert bits[0] == bits[1]
    assert len(bits[0][1][2]) == 2 and bits[0][1][2][0][1]  # b: prompt logprobs from both of its chunks


def _logprob_bits(logprobs: dict[int, Any]) -> dict[int, list[tuple[Any, ...]]]:
    """Each sequence's step logprobs as exact values: (drawn token's (token, logprob hex, rank, top), prompt's)."""
    def exact(lp: Any) -> tuple[Any, ...]:
        return (lp.token, lp.logprob.hex(), lp.rank, tuple((t, v.hex()) for t, v in lp.top))

    return {sid: [(None if s.sampled is None else exact(s.sampled), [exact(p) for p in s.prompt]) for s in steps]
            for sid, steps in logprobs.items()}


# --- POLICY-17: batch-invariant under every policy -------------------------------------------------------------


def _bits(rows: list[dict[int, Logprob]] | list[dict[int, Logprob] | None] | None) -> list[Any]:
    assert rows is not None
    return [None if row is None else sorted((t, lp.logprob.hex(), lp.rank) for t, lp in row.items()) for row in rows]


BI_PARAMS = [SamplingParams(temperature=0.0, max_tokens=m, logprobs=2, prompt_logprobs=1, ignore_eos=True)
             if i % 2 else SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=i, max_tokens=m, logprobs=2,
                                          prompt_logprobs=1, ignore_eos=True)
             for i, m in enumerate(MAX_TOKENS)]
_ALONE: dict[tuple[bool, int], tuple[list[int], list[Any], list[Any]]] = {}


def _bi_llm(on: bool, **overrides: Any) -> LLM:
    args: dict[str, Any] = {"dtype": "float32", "batch_invariant": on, "kvcache_block_size": 4,
                            "num_kvcache_blocks": ROOMY, **overrides}
    return LLM(str(checkpoint("qwen3")), **args)


def _alone(i: int, on: bool = True) -> tuple[list[int], list[Any], list[Any]]:
    """Request i alone in a fresh engine (the lesson's policy, a roomy cache, one thread): what every policy's
    crowd is held to."""
    if (on, i) not in _ALONE:
        out = _bi_llm(on).generate([PROMPTS[i]], BI_PARAMS[i], False)[0]
        _ALONE[on, i] = (out.token_ids, _bits(out.logprobs), _bits(out.prompt_logprobs))
    return _ALONE[on, i]


def _crowd(policy: str, on: bool) -> tuple[LLM, list[tuple[list[int], list[Any], list[Any]]]]:
    llm = _bi_llm(on, num_kvcache_blocks=TIGHT, scheduling_policy=policy, max_num_batched_tokens=16, max_num_seqs=3)
    outs = llm.generate(PROMPTS, BI_PARAMS, False, priority=PRIORITIES if policy == "priority" else None)
    return llm, [(o.token_ids, _bits(o.logprobs), _bits(o.prompt_logprobs)) for o in outs]


def _needs_the_mode() -> None:
    if cpu_build.find_compiler() is None:
        pytest.skip("no C compiler on the PATH: the batch-invariant mode is refused (tests/test_batch_invariant_*)")


@pytest.mark.clause("POLICY-17", "BI-10")
@pytest.mark.parametrize("policy", POLICIES)
def test_batch_invariant_output_under_every_policy_is_its_run_alone(policy: str) -> None:
    """POLICY-17, BI-10: in the batch-invariant mode (float32), under each policy, with chunks, preemptions and
    prefix-cache hits (and mixed steps under mixed), every request's tokens, logprobs and prompt logprobs (greedy
    and seeded requests) are the same bits as its run alone in a fresh engine."""
    _needs_the_mode()
    llm, got = _crowd(policy, True)
    assert llm.stats.preemptions > 0 and llm.stats.chunked_prefills > 0 and llm.stats.prefix_cache_hit_tokens > 0
    assert (llm.stats.mixed_steps > 0) is (policy == "mixed")
    for i, request in enumerate(got):
        assert request == _alone(i), f"request {i} differs from its run alone under {policy}"


@pytest.mark.clause("POLICY-17", "BI-10")
@pytest.mark.parametrize("policy", ["lesson", "mixed"])
def test_with_the_mode_off_some_bits_differ(policy: str) -> None:
    """The negative control: with the mode off the same check finds some request's logprob bits differ from its
    run alone (MKL's products depend on the batch), so the check above can fail."""
    _needs_the_mode()
    _, got = _crowd(policy, False)
    assert any(request != _alone(i, on=False) for i, request in enumerate(got))


@pytest.mark.clause("POLICY-11", "POLICY-12")
def test_an_engine_whose_limits_and_scheduler_name_other_policies_is_refused() -> None:
    """POLICY-11, POLICY-12: the validator refuses a priority by the limits' policy, the scheduler orders by its
    config's; an Engine given two different ones (a lesson's scheduler that would silently ignore the priorities
    the limits let through, or the reverse) is a ValueError naming ``scheduling_policy``. The control: the LLM's
    own pair agrees."""
    from optimized.engine.engine import Engine

    llm = _engine("priority")
    config, limits = llm.engine.scheduler.config, llm.engine.limits
    assert config.policy == limits.scheduling_policy == "priority"
    for policy in ("lesson", "mixed", "lpm"):
        with pytest.raises(ValueError, match=rf"^scheduling_policy: the limits' is 'priority', the scheduler's "
                                             rf"config's '{policy}'"):
            Engine(llm.engine.runner, replace(config, policy=policy), limits)
        with pytest.raises(ValueError, match=rf"^scheduling_policy: the limits' is '{policy}'"):
            Engine(llm.engine.runner, config, replace(limits, scheduling_policy=policy))
    Engine(llm.engine.runner, config, limits)
