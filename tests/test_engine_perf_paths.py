"""The engine's fast paths change no token: length-sorted decode ranges (planned once per step by the torch backend),
greedy rows without the random draw, the trimmed-table torch decode, row slices; each backend capability the runner
reads (capturable, reads_cache_in_place, needs_decode_plan) is declared truly and obeyed; and the throughput
benchmark states how it was fair."""

from __future__ import annotations

import argparse
import itertools
import random
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import optimized.engine.model_runner as model_runner
from kernels import cpu_build, paged_attention
from kernels.backend import DecodePlan
from kernels.sampling import sample
from kernels.torch_backend import RangePlan, TorchBackend, decode_splits
from optimized import SamplingParams
from tests.engine_fixtures import VOCAB, checkpoint, hf_greedy, make_llm

pytestmark = pytest.mark.usefixtures("engine_env")


RNG = random.Random(3)
PROMPTS = [[RNG.randrange(VOCAB) for _ in range(RNG.randrange(1, 40))] for _ in range(12)]
MAX_TOKENS = [3 + (5 * i) % 17 for i in range(12)]


# The torch backend: the sorted decode ranges under test are its path (the in-place "cpu" backend takes whole
# batches, ENG-26).
make = partial(make_llm, family="llama", num_kvcache_blocks=160, attention_backend="torch")


@pytest.mark.clause("ENG-26")
def test_decode_splits_cover_the_batch_with_widths_that_fit() -> None:
    """ENG-26: ranges are contiguous, cover every row once, respect the limits, and each is as wide as its longest
    row needs, whether the rows come sorted (the last row is the longest) or not."""
    drawn = np.random.default_rng(0).integers(1, 200, 37)
    for lens in (sorted(drawn.tolist()), drawn.tolist()):
        for max_splits, min_rows in ((32, 8), (3, 1), (8, 40), (1, 1)):
            splits = decode_splits(lens, 4, max_splits, min_rows)
            assert splits[0][0] == 0 and splits[-1][1] == len(lens)
            assert all(b == c for (_, b, _), (c, _, _) in itertools.pairwise(splits))
            assert len(splits) <= max_splits and (len(splits) == 1 or all(b - a >= min_rows for a, b, _ in splits))
            for a, b, width in splits:
                assert width == -(-max(lens[a:b]) // 4)


@pytest.mark.clause("ENG-26")
def test_split_decode_equals_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """ENG-26: with a range per row (the most splitting) float64 greedy output is still transformers'."""
    llm = make()
    backend = llm.engine.runner.backend
    assert isinstance(backend, TorchBackend)
    backend.min_split_rows = 1
    ranges: list[int] = []
    plan_decode = backend.plan_decode

    def counting(*args: Any) -> RangePlan:
        plan = plan_decode(*args)
        ranges.append(len(plan.ranges))
        return plan

    monkeypatch.setattr(backend, "plan_decode", counting)
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=0.0, max_tokens=m) for m in MAX_TOKENS], use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy(checkpoint("llama"), PROMPTS, MAX_TOKENS)
    assert len(ranges) == llm.engine.stats.decode_steps > 0 and max(ranges) == len(PROMPTS)


@pytest.mark.clause("ENG-27")
def test_greedy_rows_skip_the_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    """ENG-27: an all-greedy run never calls the sampler; a mixed run sends it only the sampled rows, and the
    tokens equal one sampler call over the whole batch."""
    calls: list[int] = []

    def counting(logits: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        calls.append(logits.shape[0])
        return sample(logits, *rest)

    monkeypatch.setattr(model_runner, "sample", counting)
    make().generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert calls == []
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, max_tokens=6, seed=i) for i in range(len(PROMPTS))]
    got = [o.token_ids for o in make().generate(PROMPTS, params, use_tqdm=False)]
    assert calls and max(calls) <= len(PROMPTS) // 2
    monkeypatch.setattr(model_runner.ModelRunner, "_sample", _whole_batch_sample)
    assert [o.token_ids for o in make().generate(PROMPTS, params, use_tqdm=False)] == got


def _whole_batch_sample(
    self: model_runner.ModelRunner, logits: torch.Tensor, rows: list[model_runner.DrawParams], positions: Any
) -> list[int]:
    """The pre-fast-path sampler: every row, greedy or not, through one sample() call."""
    drawn = sample(
        logits,
        torch.tensor([d.temperature for d in rows], dtype=torch.float32),
        torch.tensor([d.top_k for d in rows]),
        torch.tensor([d.top_p for d in rows], dtype=torch.float32),
        torch.tensor([d.seed for d in rows]),
        torch.from_numpy(positions),
    )
    out: list[int] = drawn.tolist()
    return out


@pytest.mark.clause("KERN-20", "KERN-4")
def test_torch_decode_ignores_extra_table_columns() -> None:
    """KERN-20, KERN-4: decode over a table trimmed to the widest context equals decode over the same table with
    extra -1 columns (float32 softmax order only), and a zero-context row stays zero either way."""
    gen = torch.Generator().manual_seed(9)
    block_size, kv_heads, heads, dim = 4, 2, 6, 8
    k_cache = torch.randn(30, block_size, kv_heads, dim, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(30, block_size, kv_heads, dim, generator=gen, dtype=torch.float64)
    lens = torch.tensor([9, 0, 16, 3], dtype=torch.int32)
    table = torch.randperm(30, generator=gen)[:16].reshape(4, 4).int()
    table[lens.long() <= 12, 3] = -1
    table[1] = -1
    q = torch.randn(4, heads, dim, generator=gen, dtype=torch.float64)
    wide = torch.cat([table, torch.full((4, 5), -1, dtype=torch.int32)], dim=1)
    trimmed_out = paged_attention.paged_decode(q, k_cache, v_cache, lens, table, 0.4)
    wide_out = paged_attention.paged_decode(q, k_cache, v_cache, lens, wide, 0.4)
    torch.testing.assert_close(trimmed_out, wide_out, rtol=1e-6, atol=1e-6)
    assert torch.equal(trimmed_out[1], torch.zeros_like(trimmed_out[1]))
    # Garbage in unused slots of a used block (past the context) never reaches the output.
    k_poked, v_poked = k_cache.clone(), v_cache.clone()
    k_poked[table[0, 2], 1:] += 1e3
    v_poked[table[0, 2], 1:] -= 1e3
    poked = paged_attention.paged_decode(q, k_poked, v_poked, lens, table, 0.4)
    assert torch.equal(poked[0], trimmed_out[0])


@pytest.mark.clause("KERN-21")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_planned_decode_ranges_equal_paged_decode(dtype: torch.dtype) -> None:
    """KERN-21: paged_decode_ranges is bit for bit paged_decode over each range with its trimmed table, with k and v
    adjacent in one allocation (one gather) and apart (two); a corrupted range plan is seen."""
    gen = torch.Generator().manual_seed(5)
    block_size, kv_heads, heads, dim, num_blocks = 4, 2, 6, 8, 40
    both = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen, dtype=dtype)
    lens = torch.tensor([1, 3, 4, 9, 13, 16, 17, 30], dtype=torch.int32)
    table = torch.full((8, 8), -1, dtype=torch.int32)
    ids = torch.randperm(num_blocks, generator=gen).int()
    used = 0
    for row, n in enumerate(lens.tolist()):
        table[row, : -(-n // block_size)] = ids[used : used + -(-n // block_size)]
        used += -(-n // block_size)
    q = torch.randn(8, heads, dim, generator=gen, dtype=dtype)
    splits = decode_splits(lens.tolist(), block_size, 3, 2)
    assert len(splits) == 3
    expected = torch.cat(
        [paged_attention.paged_decode(q[a:b], both[0], both[1], lens[a:b], table[a:b, :w], 0.3) for a, b, w in splits]
    )
    ranges = tuple(
        paged_attention.decode_range(a, b, lens[a:b], table[a:b, :w], block_size, False) for a, b, w in splits
    )
    assert paged_attention._kv_pair(both[0], both[1]) is not None
    assert paged_attention._kv_pair(both[0].clone(), both[1].clone()) is None
    assert torch.equal(paged_attention.paged_decode_ranges(q, both[0], both[1], ranges, 0.3), expected)
    apart = paged_attention.paged_decode_ranges(q, both[0].clone(), both[1].clone(), ranges, 0.3)
    assert torch.equal(apart, expected)
    a, b, w = splits[1]
    wrong = (
        *ranges[:1],
        paged_attention.decode_range(a, b, lens[a:b] - 1, table[a:b, :w], block_size, False),
        *ranges[2:],
    )
    assert not torch.equal(paged_attention.paged_decode_ranges(q, both[0], both[1], wrong, 0.3), expected)


def _first_prefill_hidden(chunk: int) -> tuple[torch.Tensor, list[list[int]]]:
    llm = make()
    runner = llm.engine.runner
    runner.row_chunk = chunk
    seen: list[torch.Tensor] = []
    original = runner.model.forward

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        out: torch.Tensor = original(*args, **kwargs)
        seen.append(out)
        return out

    runner.model.forward = recording  # type: ignore[method-assign]
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=0.0, max_tokens=m) for m in MAX_TOKENS], use_tqdm=False)
    return seen[0], [o.token_ids for o in outs]


@pytest.mark.clause("ENG-30")
def test_row_slices_change_no_value() -> None:
    """ENG-30: a forward in slices of 3 rows is bit for bit the whole-batch forward, and float64 greedy output with
    slices of 2 rows (prefill and decode) still equals transformers'."""
    whole, _ = _first_prefill_hidden(0)
    sliced, _ = _first_prefill_hidden(3)
    assert whole.shape[0] > 3 and torch.equal(whole, sliced)
    _, tokens = _first_prefill_hidden(2)
    assert tokens == hf_greedy(checkpoint("llama"), PROMPTS, MAX_TOKENS)


class CapabilitySpy:
    """The torch backend under the capabilities a test declares, logging each plan it makes and each decode call
    (its rows' context lengths and the plan it was handed)."""

    name = "spy"

    def __init__(self, *, reads_cache_in_place: bool, needs_decode_plan: bool, capturable: bool = False) -> None:
        self.capturable = capturable
        self.reads_cache_in_place = reads_cache_in_place
        self.needs_decode_plan = needs_decode_plan
        self.inner = TorchBackend()
        self.plans: list[DecodePlan] = []
        self.decodes: list[tuple[list[int], DecodePlan | None]] = []

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        self.inner.store_kv(k, v, k_cache, v_cache, slots)

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
        return self.inner.prefill(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)

    def plan_decode(self, context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> DecodePlan:
        plan = self.inner.plan_decode(context_lens, block_tables, block_size)
        self.plans.append(plan)
        return plan

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
        self.decodes.append((context_lens.tolist(), plan))
        return self.inner.decode(q, k_cache, v_cache, context_lens, block_tables, scale, plan)


@pytest.mark.clause("ENG-26", "ENG-30", "KERN-15")
@pytest.mark.parametrize(("in_place", "planned"), [(True, False), (False, False), (True, True), (False, True)])
def test_runner_obeys_the_declared_decode_capabilities(
    monkeypatch: pytest.MonkeyPatch, in_place: bool, planned: bool
) -> None:
    """ENG-26, ENG-30, KERN-15: a backend declaring reads_cache_in_place gets each eager decode step's whole batch in
    the scheduler's order, one that does not gets it sorted by context length; one declaring needs_decode_plan is
    asked for one plan per decode step (never for a prefill) and gets that very plan back in every layer, the
    others plan nothing and get None. Greedy float64 tokens stay transformers'."""
    llm = make()
    runner = llm.engine.runner
    spy = CapabilitySpy(reads_cache_in_place=in_place, needs_decode_plan=planned)
    runner.backend = spy
    batches: list[list[int]] = []  # the scheduler's decode batches: each row's context length, in its order
    run = runner.run

    def watched(seqs: Any, is_prefill: bool, draws: Any) -> list[int]:
        if not is_prefill:
            batches.append([s.num_tokens for s in seqs])
        return run(seqs, is_prefill, draws)

    monkeypatch.setattr(runner, "run", watched)
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=0.0, max_tokens=m) for m in MAX_TOKENS], use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy(checkpoint("llama"), PROMPTS, MAX_TOKENS)
    assert any(b != sorted(b) for b in batches)  # an order that sorting changes
    layers = runner.model.config.num_layers
    assert len(spy.decodes) == layers * len(batches) and len(spy.plans) == (len(batches) if planned else 0)
    for step, lens in enumerate(batches):
        expected_plan = spy.plans[step] if planned else None
        for got_lens, got_plan in spy.decodes[step * layers : (step + 1) * layers]:
            assert got_lens == (lens if in_place else sorted(lens))
            assert got_plan is expected_plan


@pytest.mark.clause("ENG-28", "KERN-15")
def test_graphed_decode_steps_never_plan() -> None:
    """ENG-28, KERN-15: with enforce_eager=False (the CPU stand-in graph) a backend declaring needs_decode_plan is
    never asked to plan, and every decode gets no plan (one made at capture would be stale); tokens unchanged."""
    llm = make(enforce_eager=False)
    spy = CapabilitySpy(reads_cache_in_place=False, needs_decode_plan=True)
    llm.engine.runner.backend = spy
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=0.0, max_tokens=m) for m in MAX_TOKENS], use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy(checkpoint("llama"), PROMPTS, MAX_TOKENS)
    assert llm.engine.runner.graph_steps == llm.engine.stats.decode_steps > 0
    assert spy.plans == [] and spy.decodes and all(plan is None for _, plan in spy.decodes)


@pytest.mark.clause("ENG-28", "KERN-15")
@pytest.mark.parametrize("capturable", [True, False])
def test_cuda_graphs_follow_the_declared_capturable(monkeypatch: pytest.MonkeyPatch, capturable: bool) -> None:
    """ENG-28, KERN-15: on CUDA (faked: the model loads on the CPU) enforce_eager=None captures decode graphs exactly
    when the backend declares capturable, and enforce_eager=False with a backend that does not is a ValueError
    naming enforce_eager, raised before any weight loads."""
    import kernels.backend
    from optimized.models.loader import load_model

    spy = CapabilitySpy(reads_cache_in_place=True, needs_decode_plan=False, capturable=capturable)
    monkeypatch.setattr(spy, "name", "triton")  # the engine's settings name only backends it knows
    loads: list[str] = []

    def load_on_cpu(folder: Any, dtype: torch.dtype, device: torch.device, tp: Any = None) -> Any:
        loads.append(device.type)
        return load_model(folder, dtype, torch.device("cpu"), tp)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels.backend, "get_backend", lambda name, device: spy)
    monkeypatch.setattr("optimized.models.loader.load_model", load_on_cpu)
    llm = make(device="cuda")
    assert loads == ["cuda"] and llm.enforce_eager is not capturable
    assert (llm.engine.runner.graphs is not None) is capturable
    if capturable:
        assert make(device="cuda", enforce_eager=False).engine.runner.graphs is not None
    else:
        with pytest.raises(ValueError, match="enforce_eager"):
            make(device="cuda", enforce_eager=False)
        assert loads == ["cuda"]


@pytest.mark.clause("KERN-15", "KERN-20", "KERN-24")
def test_backends_declare_their_capabilities_truly() -> None:
    """KERN-15, KERN-20, KERN-24: each backend's declared (capturable, reads_cache_in_place, needs_decode_plan); a
    backend declaring reads_cache_in_place reads no table entry past a row's context (a block id there that names
    no block changes nothing), while torch, which does not, gathers its whole table width (the same id fails)."""
    from kernels.cpu_backend import CpuBackend
    from kernels.flash_attn_backend import FlashAttnBackend
    from kernels.triton_backend import TritonBackend

    declared = {
        cls.name: (cls.capturable, cls.reads_cache_in_place, cls.needs_decode_plan)
        for cls in (TorchBackend, CpuBackend, TritonBackend, FlashAttnBackend)
    }
    assert declared == {
        "torch": (False, False, True),
        "cpu": (False, True, False),
        "triton": (True, True, False),
        "flash-attn": (True, True, False),
    }
    gen = torch.Generator().manual_seed(2)
    block_size, num_blocks = 4, 12
    k_cache = torch.randn(num_blocks, block_size, 2, 8, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, 2, 8, generator=gen)
    q = torch.randn(3, 4, 8, generator=gen)
    lens = torch.tensor([5, 2, 8], dtype=torch.int32)
    table = torch.tensor([[3, 7, -1], [1, -1, -1], [0, 9, -1]], dtype=torch.int32)
    poisoned = table.clone()
    poisoned[poisoned < 0] = num_blocks + 40  # past every context: read only by a backend that gathers the width
    expected = paged_attention.paged_decode(q, k_cache, v_cache, lens, table, 0.3)
    in_place: list[Any] = [TritonBackend()]
    if cpu_build.unavailable_reason() is None:
        in_place.append(CpuBackend())
    for backend in in_place:
        got = backend.decode(q, k_cache, v_cache, lens, poisoned, 0.3)
        torch.testing.assert_close(got, expected, rtol=5e-6, atol=5e-6)
    with pytest.raises((IndexError, RuntimeError)):
        TorchBackend().decode(q, k_cache, v_cache, lens, poisoned, 0.3)


@pytest.mark.clause("ENG-29")
def test_throughput_benchmark_states_its_fairness(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """ENG-29: one thread count set for both sides and printed; static batches of the stated size; requests
    with identical tokens reported; only requested tokens counted."""
    from optimized.benchmarks.throughput import run
    from optimized.engine.args import EngineArgs

    monkeypatch.setenv("NANOVERIFY_CACHE", str(tmp_path))
    args = argparse.Namespace(num_requests=5, max_input_len=9, max_output_len=5, threads=1, hf_batch_size=2)
    assert run(args, EngineArgs(device="cpu")) == 0
    out = capsys.readouterr().out
    assert "1 torch threads for both sides" in out and "static left-padded batches of 2" in out
    line = next(s for s in out.splitlines() if s.startswith("requests with identical tokens on both sides"))
    same, total = line.split(": ")[1].split("/")
    assert total == "5" and 0 <= int(same) <= 5
