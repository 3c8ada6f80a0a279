"""What the model runner computes in each step, watched from inside: the attention backend, the model's inputs,
its logits and the sampler (ENG-2, ENG-3, ENG-4).

The runner's backend is replaced by a spy that delegates to the engine's default backend and logs every call with
its layer and rows; ``ModelRunner.run`` is wrapped to snapshot the batch the scheduler granted (each sequence's
``num_cached_tokens``, ``num_scheduled_tokens``, tokens and block table) before the step, and a forward pre-hook
records the input ids and positions the model gets. Each step is then checked against the grant alone. The spy
declares that it gathers its table's width (not ``reads_cache_in_place``), so decode rows come sorted by context
length (ENG-26), and plans decode steps exactly when the backend it wraps does. Every scenario also ends in
transformers' greedy tokens, so the KV the runner skipped recomputing was the right KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from kernels.backend import AttentionBackend, DecodePlan
from optimized import LLM, SamplingParams
from optimized.engine.model_runner import PLACEHOLDER, DrawParams, ModelRunner, ScheduledSeq
from tests.engine_fixtures import checkpoint, hf_greedy

pytestmark = pytest.mark.usefixtures("engine_env")


@dataclass(frozen=True)
class Call:
    kind: str  # "store_kv", "prefill" or "decode"
    layer: int
    rows: int  # k rows for store_kv, query rows otherwise
    slots: tuple[int, ...] = ()
    cu_seqlens_q: tuple[int, ...] = ()
    context_lens: tuple[int, ...] = ()


class SpyBackend:
    """The engine's default backend (the compiled "cpu" one where it builds), with every call logged (layer found
    from the cache tensor it is handed)."""

    capturable = False
    reads_cache_in_place = False

    def __init__(self, inner: AttentionBackend, runner: ModelRunner) -> None:
        self.name = "spy"
        self.needs_decode_plan = inner.needs_decode_plan
        self.inner = inner
        self.layer_of = {k.data_ptr(): i for i, (k, _) in enumerate(runner.kv_views)}
        self.calls: list[Call] = []

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        layer = self.layer_of[k_cache.data_ptr()]
        self.calls.append(Call("store_kv", layer, k.shape[0], tuple(slot_mapping.tolist())))
        self.inner.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        layer = self.layer_of[k_cache.data_ptr()]
        cu, lens = tuple(cu_seqlens_q.tolist()), tuple(context_lens.tolist())
        self.calls.append(Call("prefill", layer, q.shape[0], cu_seqlens_q=cu, context_lens=lens))
        return self.inner.prefill(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)

    def plan_decode(self, context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> DecodePlan:
        return self.inner.plan_decode(context_lens, block_tables, block_size)

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
        plan: DecodePlan | None = None,
    ) -> torch.Tensor:
        layer = self.layer_of[k_cache.data_ptr()]
        self.calls.append(Call("decode", layer, q.shape[0], context_lens=tuple(context_lens.tolist())))
        return self.inner.decode(q, k_cache, v_cache, context_lens, block_tables, scale, plan)


@dataclass(frozen=True)
class Granted:
    """A scheduled sequence as the runner received it."""

    seq_id: int
    cached: int
    scheduled: int
    num_tokens: int
    token_ids: tuple[int, ...]
    block_table: tuple[int, ...]
    first_grant: bool  # allocated in this step (the engine counts its cached tokens as prefix-cache hits)


@dataclass
class Step:
    is_prefill: bool
    batch: list[Granted]
    calls: list[Call] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)  # rows of each model.logits call
    sampled_positions: list[list[int]] = field(default_factory=list)  # positions handed to each _sample call
    tokens: list[int] = field(default_factory=list)


class Watch:
    """Installs the spies on an LLM's runner and collects one ``Step`` per runner call."""

    def __init__(self, llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
        runner = llm.engine.runner
        self.runner = runner
        self.backend = SpyBackend(runner.backend, runner)
        runner.backend = self.backend
        self.steps: list[Step] = []
        self.seen: set[int] = set()
        run, logits, sample = runner.run, runner.model.logits, runner._sample

        def watched_run(seqs: Sequence[ScheduledSeq], is_prefill: bool, draws: Sequence[DrawParams]) -> list[int]:
            step = Step(is_prefill, [self._granted(s) for s in seqs])
            self.steps.append(step)
            self.backend.calls = step.calls
            step.tokens = run(seqs, is_prefill, draws)
            return step.tokens

        def watched_logits(hidden: torch.Tensor) -> torch.Tensor:
            self.steps[-1].logit_rows.append(hidden.shape[0])
            return logits(hidden)

        def watched_sample(logits: torch.Tensor, rows: list[DrawParams], positions: Any) -> list[int]:
            self.steps[-1].sampled_positions.append([int(p) for p in positions])
            return sample(logits, rows, positions)

        def record_inputs(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            self.steps[-1].input_ids = args[0].tolist()
            self.steps[-1].positions = args[1].tolist()

        monkeypatch.setattr(runner, "run", watched_run)
        monkeypatch.setattr(runner.model, "logits", watched_logits)
        monkeypatch.setattr(runner, "_sample", watched_sample)
        self.hook = runner.model.register_forward_pre_hook(record_inputs)  # the LLM is the test's own

    def _granted(self, s: Any) -> Granted:
        first = s.seq_id not in self.seen
        self.seen.add(s.seq_id)
        tokens = tuple(s.token_ids)
        return Granted(
            s.seq_id, s.num_cached_tokens, s.num_scheduled_tokens, s.num_tokens, tokens, tuple(s.block_table), first
        )


def make_llm(**kwargs: Any) -> LLM:
    args: dict[str, Any] = {"dtype": "float64", "device": "cpu", "check": True, "kvcache_block_size": 4}
    return LLM(str(checkpoint("qwen3")), **{**args, "num_kvcache_blocks": 64, **kwargs})


def granted_positions(g: Granted) -> list[int]:
    return list(range(g.cached, g.cached + g.scheduled))


def slot(g: Granted, position: int, block_size: int) -> int:
    return g.block_table[position // block_size] * block_size + position % block_size


def runner_rows(step: Step, block_size: int) -> list[Granted]:
    """The batch in the order the runner laid out its rows: the scheduler's for a prefill; for a decode, ordered
    by context length (ENG-26), read back from the slots the first store wrote (one distinct slot per row)."""
    if step.is_prefill:
        return step.batch
    by_slot = {slot(g, g.num_tokens - 1, block_size): g for g in step.batch}
    stored = next(c for c in step.calls if c.kind == "store_kv" and c.layer == 0).slots
    rows = [by_slot[s] for s in stored]
    assert sorted(g.seq_id for g in rows) == sorted(g.seq_id for g in step.batch)
    assert [g.num_tokens for g in rows] == sorted(g.num_tokens for g in rows)
    return rows


def check_step_computes_the_grant(step: Step, num_layers: int, block_size: int) -> None:
    """ENG-2 for one step: the model gets exactly the granted positions and their tokens; in every layer the KV of
    exactly those positions is stored into their slots, then one attention call over exactly those query rows."""
    rows = runner_rows(step, block_size)
    positions = [p for g in rows for p in granted_positions(g)]
    assert step.positions == positions
    assert step.input_ids == [g.token_ids[p] for g in rows for p in granted_positions(g)]
    slots = tuple(slot(g, p, block_size) for g in rows for p in granted_positions(g))
    attention = "prefill" if step.is_prefill else "decode"
    for layer in range(num_layers):
        calls = [c for c in step.calls if c.layer == layer]
        stores = [c for c in calls if c.kind == "store_kv"]
        assert [c.kind for c in calls] == ["store_kv"] * len(stores) + [attention], f"layer {layer}: {calls}"
        assert tuple(s for c in stores for s in c.slots) == slots
        assert sum(c.rows for c in stores) == len(positions)
        query = calls[-1]
        assert query.rows == sum(g.scheduled for g in rows)
        assert query.context_lens == tuple(g.cached + g.scheduled for g in rows)
        if step.is_prefill:
            starts = [0]
            for g in rows:
                starts.append(starts[-1] + g.scheduled)
            assert query.cu_seqlens_q == tuple(starts)
    layers_in_order = [c.layer for c in step.calls if c.kind == attention]
    assert layers_in_order == list(range(num_layers))


def check_step_samples_only_finished_prompts(step: Step) -> None:
    """ENG-4 for one step: logits and a draw only for sequences whose prompt is complete after it (each at the
    index of its new token), the placeholder for the others."""
    done = [g.cached + g.scheduled == g.num_tokens for g in step.batch]
    assert step.tokens is not None and len(step.tokens) == len(step.batch)
    for finished, token in zip(done, step.tokens, strict=True):
        assert (token == PLACEHOLDER) == (not finished)
    if any(done):
        assert step.logit_rows == [sum(done)]
        assert sorted(p for call in step.sampled_positions for p in call) == sorted(
            g.num_tokens for g, d in zip(step.batch, done, strict=True) if d
        )
    else:
        assert step.logit_rows == [] and step.sampled_positions == []


def check_all(watch: Watch, llm: LLM) -> None:
    c = llm.engine.runner.model.config
    assert watch.steps
    for step in watch.steps:
        check_step_computes_the_grant(step, c.num_layers, llm.engine.runner.block_size)
        check_step_samples_only_finished_prompts(step)


GREEDY = 0.0


@pytest.mark.clause("ENG-2", "ENG-30", "ENG-26")
def test_each_step_computes_exactly_the_granted_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """ENG-2: every prefill and decode step, in a batch of several sequences and with the row-wise work sliced
    (ENG-30), computes positions [num_cached_tokens, num_cached_tokens + num_scheduled_tokens) of each scheduled
    sequence: store_kv of those slots then prefill or decode, in every layer."""
    llm = make_llm()
    watch = Watch(llm, monkeypatch)
    llm.engine.runner.row_chunk = 5  # slices the row-wise work of the longer steps: store_kv runs per slice
    prompts = [[9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11], [40, 41, 42], [200, 100, 50, 25, 12, 6, 3]]
    outs = llm.generate(prompts, SamplingParams(temperature=GREEDY, max_tokens=6), use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy(checkpoint("qwen3"), prompts, [6] * 3)
    check_all(watch, llm)
    kinds = {(s.is_prefill, len(s.batch)) for s in watch.steps}
    assert (True, 3) in kinds and (False, 3) in kinds
    # The slicing did split the stores of the prefill (21 rows in slices of 5): more than one per layer there.
    prefill = next(s for s in watch.steps if s.is_prefill)
    assert sum(c.kind == "store_kv" for c in prefill.calls) == 5 * llm.engine.runner.model.config.num_layers


@pytest.mark.clause("ENG-3", "ENG-26")
def test_prefix_cache_hit_is_not_recomputed(monkeypatch: pytest.MonkeyPatch) -> None:
    """ENG-3: a sequence allocated with num_cached_tokens > 0 computes only its positions from there (its first
    query position is its cached count), attends to the cached blocks' KV (its context is the whole prompt), and
    the engine counts the hit tokens; its tokens are transformers'."""
    llm = make_llm()
    watch = Watch(llm, monkeypatch)
    shared = [17, 33, 250, 4, 91, 2, 60, 77, 5, 180, 13, 99]  # three full blocks of 4
    first, second = [*shared, 1], [*shared, 200, 201, 202]
    params = SamplingParams(temperature=GREEDY, max_tokens=5)
    llm.generate([first], params, use_tqdm=False)
    hits_before = llm.engine.stats.prefix_cache_hit_tokens
    steps_before = len(watch.steps)
    out = llm.generate([second], params, use_tqdm=False)
    assert out[0].token_ids == hf_greedy(checkpoint("qwen3"), [second], [5])[0]
    check_all(watch, llm)
    prefill = watch.steps[steps_before]
    assert prefill.is_prefill and len(prefill.batch) == 1
    g = prefill.batch[0]
    assert g.first_grant and g.cached == len(shared) and g.scheduled == len(second) - len(shared)
    assert prefill.positions[0] == g.cached
    assert prefill.positions == list(range(len(shared), len(second)))
    assert llm.engine.stats.prefix_cache_hit_tokens - hits_before == len(shared)
    # No layer stored or queried a row of the cached prefix.
    assert all(c.rows == len(second) - len(shared) for c in prefill.calls)
    assert all(c.context_lens == (len(second),) for c in prefill.calls if c.kind == "prefill")


@pytest.mark.clause("ENG-4", "ENG-26")
def test_unfinished_chunk_gets_the_placeholder_and_no_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """ENG-4: a chunk of a chunked prefill attends to all KV its sequence has cached so far (its context is every
    earlier chunk plus itself); logits are computed and a token drawn only for sequences whose prompt is complete
    after the step; an unfinished chunk yields PLACEHOLDER, which postprocess discards."""
    llm = make_llm(max_num_batched_tokens=5)
    watch = Watch(llm, monkeypatch)
    prompts = [[3, 1, 4], [27, 18, 28, 18, 28, 45, 90, 45, 23, 53, 60, 28]]
    params = [SamplingParams(temperature=GREEDY, max_tokens=4), SamplingParams(temperature=0.7, max_tokens=4, seed=3)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[0].token_ids == hf_greedy(checkpoint("qwen3"), prompts[:1], [4])[0]
    assert all(PLACEHOLDER not in o.token_ids and len(o.token_ids) == 4 for o in outs)
    check_all(watch, llm)
    chunks = [(s, g) for s in watch.steps if s.is_prefill for g in s.batch if g.cached + g.scheduled < g.num_tokens]
    assert chunks, "no chunked prefill happened"
    # A step whose only work is an unfinished chunk computes no logits at all ...
    assert any(len(s.batch) == 1 and s.logit_rows == [] for s, _ in chunks)
    # ... while the chunk that completes the prompt computes one logits row and draws at the new token's index.
    # (An unfinished chunk is always alone in its batch: only a batch's first sequence is chunked, with all the
    # token budget left, lesson section 3.)
    last = [s for s in watch.steps if s.is_prefill and s.batch[0].cached > 0 and s.tokens[0] != PLACEHOLDER]
    assert [(s.logit_rows, s.sampled_positions) for s in last] == [([1], [[len(prompts[1])]])]
    # A later chunk starts where the earlier ones stopped and attends over all of them.
    later = [(s, g) for s in watch.steps if s.is_prefill for g in s.batch if g.cached > 0]
    assert later
    for s, g in later:
        row = s.batch.index(g)
        assert all(c.context_lens[row] == g.cached + g.scheduled for c in s.calls if c.kind == "prefill")
    assert llm.engine.stats.chunked_prefills >= 2
    # The chunked (sampled) request draws what it draws unchunked: chunking changed no KV it read.
    whole = make_llm().generate(prompts[1:], params[1:], use_tqdm=False)
    assert whole[0].token_ids == outs[1].token_ids
