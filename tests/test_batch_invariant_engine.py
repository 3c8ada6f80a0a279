"""The engine's batch-invariant mode (spec/batch-invariance.md, BI-6..BI-10): refused with its reason where it cannot
hold (and not even asked when it is off); its attention never falls back to torch's; in it every op of the forward
pass gives a row the same bits alone or in a batch; and a request's tokens and final logits (the runner's raw logits,
float64 unrounded) are the same bits alone, in a crowd, chunked, preempted, on a hot prefix cache, at 1 or 2 threads.
The negative control: with the mode off the same checks find differences, in float32 and in float64."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import cpu_build, linear
from kernels.norm import add_rms_norm, rms_norm
from kernels.rotary import rotary_cos_sin, rotary_rows, rotate
from kernels.sampling import sample
from optimized.engine.args import EngineArgs
from optimized.engine.assembly import batch_invariant_refusal
from optimized.engine.sampling_params import SamplingParams
from optimized.entry.llm import LLM
from optimized.models.decoder import MLP, Linear
from tests.engine_fixtures import at_threads, checkpoint

pytestmark = [pytest.mark.usefixtures("engine_env")]
VOCAB = 256


@pytest.fixture(autouse=True)
def _kernels_built() -> None:
    if cpu_build.find_compiler() is None:
        pytest.skip("no C compiler on the PATH: the mode is refused (tested below)")
    assert cpu_build.unavailable_reason() is None


def make(on: bool | None = True, **overrides: Any) -> LLM:
    args: dict[str, Any] = {"dtype": "float32", "batch_invariant": on, "kvcache_block_size": 4,
                            "num_kvcache_blocks": 256, **overrides}
    return LLM(str(checkpoint("qwen3")), **args)


@dataclass
class Done:
    tokens: list[int]
    logits: torch.Tensor  # [generated, vocab]: the logits each token was drawn from


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[Done]:
    """Each request's tokens and the logits rows they were drawn from (captured by the runner's observer, keyed by
    sequence and position, so a recompute after preemption cannot hide a row)."""
    rows: dict[tuple[int, int], torch.Tensor] = {}

    def observe(seqs: list[Any], logits: torch.Tensor) -> None:
        for s, row in zip(seqs, logits, strict=True):
            key = (s.seq_id, s.num_tokens)
            assert key not in rows
            rows[key] = row.clone()

    runner = llm.engine.runner
    runner.logits_observer = observe
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.logits_observer = None
    seq_ids = sorted({k[0] for k in rows})
    assert len(seq_ids) == len(prompts)
    done = []
    for out, sid in zip(outs, seq_ids, strict=True):
        mine = sorted((pos, row) for (s, pos), row in rows.items() if s == sid)
        assert len(mine) == len(out.token_ids)
        done.append(Done(list(out.token_ids), torch.stack([row for _, row in mine])))
    return done


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def seeded(n: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=seed, max_tokens=n, ignore_eos=True)


def prompt(rng: random.Random, lo: int, hi: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))]


def same(a: Done, b: Done) -> bool:
    return a.tokens == b.tokens and torch.equal(a.logits, b.logits)


NEEDLES = [
    ([(7 * i + 3) % VOCAB for i in range(23)], greedy(10)),
    ([(5 * i + 1) % VOCAB for i in range(13)], seeded(10, 4)),
]
_ALONE: dict[tuple[bool, str, int], Done] = {}


def alone(needle: int, on: bool = True, dtype: str = "float32") -> Done:
    """The needle alone in a fresh engine, at one thread: the reference every crowd is held to."""
    key = (on, dtype, needle)
    if key not in _ALONE:
        p, params = NEEDLES[needle]
        with at_threads(1):
            _ALONE[key] = run(make(on, dtype=dtype), [p], [params])[0]
    return _ALONE[key]


def crowd(rng: random.Random, needle: int, mates: int) -> tuple[list[list[int]], list[SamplingParams], int]:
    """The needle at a random place among ``mates`` random requests (greedy and seeded, random lengths)."""
    prompts = [prompt(rng, 1, 40) for _ in range(mates)]
    params = [greedy(rng.randint(1, 12)) if rng.random() < 0.5 else seeded(rng.randint(1, 12), rng.randrange(99))
              for _ in range(mates)]
    at = rng.randint(0, mates)
    prompts.insert(at, NEEDLES[needle][0])
    params.insert(at, NEEDLES[needle][1])
    return prompts, params, at


# --- the mode: a field, refused where it cannot hold (BI-7) ---


@pytest.mark.clause("BI-7", "BI-10")
def test_the_mode_is_one_field_on_by_default_in_float32_and_binds_every_linear_layer() -> None:
    """BI-7, BI-10: ``batch_invariant`` is one EngineArgs field (so a flag on every engine command), None by default,
    which resolves to on in float32 with the C kernels and the 'cpu' attention, and to off in float64; on, every
    linear layer and the LM head run the invariant kernel and every MLP the invariant SiLU; off, none does."""
    assert EngineArgs().batch_invariant is None
    assert EngineArgs(batch_invariant=True).cli_flags() == ["--batch-invariant"]
    for dtype, asked, on in (("float32", None, True), ("float32", False, False), ("float32", True, True),
                             ("float64", None, False), ("float64", True, True)):
        llm = LLM(str(checkpoint("qwen3")), dtype=dtype, num_kvcache_blocks=64,
                  **({} if asked is None else {"batch_invariant": asked}))
        assert llm.settings.batch_invariant is on, (dtype, asked)
        net = llm.network()
        layers = [m for m in net.modules() if isinstance(m, Linear)]
        assert len(layers) == 1 + 4 * 2  # the LM head, and qkv, o, gate_up, down of both layers
        assert all((m.invariant is not None) is on for m in layers)
        assert all(m.batch_invariant is on for m in net.modules() if isinstance(m, MLP))


@pytest.mark.clause("BI-10")
def test_the_default_is_off_where_the_mode_cannot_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """BI-10: left at None, the mode is off (never refused) where it cannot hold: without the C kernels, or with
    torch's attention, in float32 too."""
    assert make(None, attention_backend="torch").settings.batch_invariant is False
    monkeypatch.setattr(cpu_build, "unavailable_reason", lambda: "no C compiler (a test)")
    assert make(None).settings.batch_invariant is False


@pytest.mark.clause("BI-7")
def test_where_it_cannot_hold_it_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """BI-7: asked for on CUDA, in bfloat16 or float16, with torch's attention, or without the C kernels, the engine
    refuses with one line naming the reason, before loading weights; None there is simply off. Every
    tensor-parallel size holds (TP-11)."""
    cpu = torch.device("cpu")
    assert batch_invariant_refusal(cpu, "float32", "cpu") is None
    assert batch_invariant_refusal(cpu, "float64", "cpu") is None
    refusals = {
        "device cuda": batch_invariant_refusal(torch.device("cuda"), "float32", "cpu"),
        "dtype bfloat16": batch_invariant_refusal(cpu, "bfloat16", "cpu"),
        "attention backend 'torch'": batch_invariant_refusal(cpu, "float32", "torch"),
    }
    for start, reason in refusals.items():
        assert reason is not None and reason.startswith(start) and "\n" not in reason, reason
    cases: tuple[tuple[dict[str, Any], str], ...] = (({"dtype": "float16"}, "dtype float16"),
                                                     ({"attention_backend": "torch"}, "attention"))
    for kwargs, start in cases:
        with pytest.raises(ValueError, match=f"^batch_invariant cannot hold: {start}"):
            make(**kwargs)
    assert make(None, attention_backend="torch").settings.batch_invariant is False
    monkeypatch.setattr(cpu_build, "unavailable_reason", lambda: "no C compiler (a test)")
    reason = batch_invariant_refusal(cpu, "float32", "cpu")
    assert reason is not None and "no C compiler (a test)" in reason and "torch emulation" in reason


@pytest.mark.clause("BI-7")
def test_the_refusal_is_asked_only_when_the_mode_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """BI-7: with the mode off (False, or None with torch's attention) the build never computes the refusal, which
    would build the C library (up to the build's timeout) even for torch's attention."""
    from optimized.entry import build

    def refuse(*args: Any) -> str:
        raise AssertionError("batch_invariant_refusal called with the mode off")

    monkeypatch.setattr(build, "batch_invariant_refusal", refuse)
    for off in (False, None):
        assert make(off, attention_backend="torch", num_kvcache_blocks=16).settings.batch_invariant is False
    with pytest.raises(AssertionError, match="called with the mode off"):
        make(True)


@pytest.mark.clause("BI-4", "BI-7")
def test_in_the_mode_the_attention_never_falls_back_to_torch() -> None:
    """BI-4, BI-7: the mode's runner has the "cpu" backend made strict: tensors its C kernels cannot take (a cache
    that is not contiguous) are a ValueError with the reason, where the plain backend quietly runs torch's attention,
    whose prefill and decode sum keys in different orders."""
    from kernels.cpu_backend import CpuBackend

    backend = make().engine.runner.backend
    assert isinstance(backend, CpuBackend) and backend.batch_invariant
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(4, 4, 2, 2, 8, generator=g)[:, :, :, 0]  # [blocks, block size, kv heads, dim], strided
    q = torch.randn(3, 4, 8, generator=g)
    lens, table = torch.tensor([5, 9, 1], dtype=torch.int32), torch.tensor([[0, 1, 2]] * 3, dtype=torch.int32)
    plain, strict = CpuBackend(), CpuBackend(batch_invariant=True)
    assert plain.decode(q, cache, cache, lens, table, 0.3).shape == q.shape  # torch's, quietly
    with pytest.raises(ValueError, match=r"^batch_invariant: the C attention cannot take these tensors \(k_cache "
                                         r"is not contiguous"):  # fmt: skip
        strict.decode(q, cache, cache, lens, table, 0.3)
    cu, ctx = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([9], dtype=torch.int32)
    with pytest.raises(ValueError, match="k_cache is not contiguous"):
        strict.prefill(q, cache, cache, cu, ctx, table[:1], 0.3)
    contiguous = cache.contiguous()
    assert torch.equal(strict.decode(q, contiguous, contiguous, lens, table, 0.3),
                       plain.decode(q, contiguous, contiguous, lens, table, 0.3))  # fmt: skip


# --- every op of the forward pass, row by row (BI-8) ---


def rows_alone_differ(fn: Any, x: torch.Tensor) -> int:
    y = fn(x)
    return sum(not torch.equal(y[i : i + 1], fn(x[i : i + 1])) for i in range(x.shape[0]))


def invariant_silu_mul(width: int) -> Any:
    mlp = MLP.__new__(MLP)
    torch.nn.Module.__init__(mlp)
    mlp.intermediate_size, mlp.batch_invariant = width, True
    mlp.gate_up_proj = mlp.down_proj = torch.nn.Identity()  # type: ignore[assignment]
    return mlp


@pytest.mark.clause("BI-8")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_other_op_of_the_forward_pass_is_row_independent(dtype: torch.dtype) -> None:
    """BI-8: the ops between the linear layers and attention (embedding, RMSNorm with and without the residual add,
    q/k norm over heads, rotary, the invariant SiLU times up, the sampler on logits) give each row the same bits
    alone as in batches of 1..300 rows, at 1, 2 and 3 threads, widths that are and are not multiples of the vector
    width."""
    g = torch.Generator().manual_seed(0)
    cos_sin = rotary_cos_sin(16, 512, 5000.0, dtype, torch.device("cpu"))
    for threads in (1, 2, 3):
        with at_threads(threads):
            for m in (3, 37, 300):
                for h in (64, 100):
                    w = 1 + 0.2 * torch.randn(h, generator=g, dtype=dtype)
                    x = torch.randn(m, 2 * h, generator=g, dtype=dtype) * 3
                    assert rows_alone_differ(lambda t, w=w, h=h: rms_norm(t[:, :h], w, 1e-6), x) == 0
                    assert rows_alone_differ(lambda t, w=w, h=h: add_rms_norm(t[:, :h], t[:, h:], w, 1e-6)[0], x) == 0
                    heads = x[:, :h].reshape(m, -1, 4)
                    assert rows_alone_differ(lambda t: rms_norm(t, torch.ones(4, dtype=dtype), 1e-6), heads) == 0
                for width in (128, 129, 768):
                    gu = torch.randn(m, 2 * width, generator=g, dtype=dtype) * 6
                    assert rows_alone_differ(invariant_silu_mul(width), gu) == 0
                qk = torch.randn(m, 6, 16, generator=g, dtype=dtype)
                pos = torch.randint(0, 512, (m,), generator=g)
                rotated = rotate(qk, *rotary_rows(pos, cos_sin, dtype))
                for i in range(m):
                    alone_row = rotate(qk[i : i + 1], *rotary_rows(pos[i : i + 1], cos_sin, dtype))
                    assert torch.equal(rotated[i : i + 1], alone_row)
                table = torch.randn(VOCAB, 64, generator=g, dtype=dtype)
                ids = torch.randint(0, VOCAB, (m,), generator=g)
                assert rows_alone_differ(lambda t, table=table: F.embedding(t, table), ids) == 0
                logits = torch.randn(m, VOCAB + 1, generator=g) * 4
                knobs = (torch.full((m,), 0.8), torch.randint(0, 50, (m,)), torch.full((m,), 0.9),
                         torch.randint(0, 1 << 30, (m,)), torch.randint(0, 200, (m,)))
                drawn = sample(logits, *knobs)
                assert all(int(drawn[i]) == int(sample(logits[i : i + 1], *(k[i : i + 1] for k in knobs))[0])
                           for i in range(m))
                assert rows_alone_differ(lambda t: torch.log_softmax(t, -1), logits) == 0


@pytest.mark.clause("BI-8")
def test_torch_silu_is_not_row_independent_at_three_threads() -> None:
    """BI-8's negative control: ``F.silu`` computes the elements a thread's split leaves past its last full vector
    with a scalar exp, which rounds differently, so at 3 threads a row's bits depend on the batch (here at the tiny
    checkpoints' intermediate width, 128); the invariant form does not."""
    g = torch.Generator().manual_seed(2)
    plain = invariant_silu_mul(128)
    plain.batch_invariant = False
    found = 0
    with at_threads(3):
        for m in (50, 301, 601, 1000):
            gu = torch.randn(m, 2 * 128, generator=g) * 6
            found += rows_alone_differ(plain, gu)
            assert rows_alone_differ(invariant_silu_mul(128), gu) == 0
    assert found > 0


# --- the model: row slicing and float64 (BI-6, BI-9) ---


@pytest.mark.clause("BI-6")
def test_float64_gemm_is_batch_dependent_and_the_invariant_one_is_not() -> None:
    """BI-6: MKL's float64 F.linear gives a row other bits at M = 1 than in a batch; the float64 invariant linear
    does not, at 1 and 2 threads, bound to a layer or not, and stays within float64 rounding of MKL's."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 64, generator=g, dtype=torch.float64)
    w = torch.randn(129, 64, generator=g, dtype=torch.float64) / 8
    b = torch.randn(129, generator=g, dtype=torch.float64)
    assert rows_alone_differ(lambda t: F.linear(t, w, b), x) > 0
    bound = linear.BoundLinear(w, b)
    for threads in (1, 2):
        with at_threads(threads):
            assert rows_alone_differ(lambda t: linear.invariant_linear(t, w, b), x) == 0
            assert rows_alone_differ(bound, x) == 0
            assert torch.equal(bound(x), linear.invariant_linear(x, w, b))
    assert float((bound(x) - F.linear(x, w, b)).abs().max()) < 1e-13
    with pytest.raises(ValueError, match="does not fit this layer"):
        bound(x.float())


@pytest.mark.clause("BI-9")
def test_row_slicing_changes_no_bit_in_the_mode() -> None:
    """BI-9: the runner's row slices (CPU_ROW_CHUNK, here 8 rows so a 17-token prompt is cut 8 + 8 + 1) change no
    bit of the logits in the mode; with the mode off they do (MKL's product of a row depends on the slice)."""
    p = [(11 * i + 5) % VOCAB for i in range(17)]
    found_off = False
    for on in (True, False):
        whole, sliced = make(on), make(on)
        whole.engine.runner.row_chunk = 0
        sliced.engine.runner.row_chunk = 8
        a, b = (run(llm, [p], [greedy(3)])[0] for llm in (whole, sliced))
        if on:
            assert same(a, b)
        else:
            found_off = not torch.equal(a.logits[0], b.logits[0])
    assert found_off


# --- the engine: a request's tokens and logits whatever else runs (BI-10) ---


@pytest.mark.clause("BI-10")
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), needle=st.sampled_from([0, 1]), mates=st.integers(1, 9),
       budget=st.sampled_from([8192, 16, 7]), threads=st.sampled_from([1, 2]))
def test_a_needle_in_a_crowd_is_the_same_bits_as_alone(seed: int, needle: int, mates: int, budget: int,
                                                       threads: int) -> None:
    """BI-10: a request (greedy or seeded) at a random place in a random batch of greedy and seeded requests, its
    prompt prefilled whole or in chunks (a token budget of 16 or 7), at 1 or 2 threads, gets the same tokens and
    the same logits bits as alone in a fresh engine at 1 thread."""
    prompts, params, at = crowd(random.Random(seed), needle, mates)
    with at_threads(threads):
        got = run(make(max_num_batched_tokens=budget, max_num_seqs=16), prompts, params)[at]
    assert same(got, alone(needle))


@pytest.mark.clause("BI-10")
def test_preemption_and_recompute_change_no_bit() -> None:
    """BI-10: with KV blocks so few that the crowd preempts (recomputed through prefill, the keys decode had
    written now written by a prefill), every request's tokens and logits equal its run alone."""
    rng = random.Random(3)
    prompts = [prompt(rng, 10, 30) for _ in range(6)] + [NEEDLES[0][0]]
    params = [greedy(14) for _ in range(6)] + [NEEDLES[0][1]]
    tight = make(num_kvcache_blocks=24)
    got = run(tight, prompts, params)
    assert tight.stats.preemptions > 0
    assert same(got[-1], alone(0))
    roomy = make()
    for p, params_i, g in zip(prompts[:3], params[:3], got[:3], strict=False):
        assert same(g, run(roomy, [p], [params_i])[0])


@pytest.mark.clause("BI-10")
def test_a_hot_prefix_cache_changes_no_bit_even_on_blocks_decode_wrote() -> None:
    """BI-10: a second pass of the needle hits the prefix cache its first pass filled, and a request whose prompt is
    the needle's prompt and completion hits blocks that decode steps wrote; both equal a cold engine's run."""
    llm = make()
    first = run(llm, [NEEDLES[0][0]], [NEEDLES[0][1]])[0]
    hits = llm.stats.prefix_cache_hit_tokens
    assert same(run(llm, [NEEDLES[0][0]], [NEEDLES[0][1]])[0], first)
    assert llm.stats.prefix_cache_hit_tokens > hits
    longer = NEEDLES[0][0] + first.tokens
    hits = llm.stats.prefix_cache_hit_tokens
    hot = run(llm, [longer], [greedy(4)])[0]
    assert llm.stats.prefix_cache_hit_tokens - hits > len(NEEDLES[0][0])  # blocks past the prompt: decode's
    assert same(hot, run(make(), [longer], [greedy(4)])[0])


@pytest.mark.clause("BI-10")
def test_float64_mode_holds_in_a_crowd() -> None:
    """BI-10 in float64: the needle in a crowd, chunked, gets the same tokens and the same float64 logits bits (the
    runner hands its observer the raw logits, not a float32 copy) as its run alone."""
    prompts, params, at = crowd(random.Random(5), 0, 6)
    got = run(make(dtype="float64", max_num_batched_tokens=16), prompts, params)[at]
    assert got.logits.dtype == torch.float64
    assert same(got, alone(0, dtype="float64"))


@pytest.mark.clause("BI-10")
def test_with_the_mode_off_float64_logits_differ() -> None:
    """BI-10's negative control in float64: with the mode off the needle's float64 logits in a crowd (whole or
    chunked) differ from its run alone in some bit, so the float64 check above can fail."""
    differ = 0
    for seed in range(2):
        for budget in (8192, 7):
            prompts, params, at = crowd(random.Random(seed), 0, 5)
            got = run(make(False, dtype="float64", max_num_batched_tokens=budget), prompts, params)[at]
            assert got.logits.dtype == torch.float64
            differ += not torch.equal(got.logits, alone(0, on=False, dtype="float64").logits)
    assert differ > 0


@pytest.mark.clause("BI-10")
def test_with_the_mode_off_the_same_checks_find_differences() -> None:
    """BI-10's negative control: with the mode off, in float32, the needle's logits in a crowd (or chunked) differ
    from its run alone in some bit, so the checks above can fail."""
    rng = random.Random(0)
    differ = 0
    for needle in (0, 1):
        for budget in (8192, 7):
            prompts, params, at = crowd(rng, needle, 5)
            got = run(make(False, max_num_batched_tokens=budget), prompts, params)[at]
            differ += not torch.equal(got.logits, alone(needle, on=False).logits)
    assert differ > 0


@pytest.mark.clause("BI-7", "BI-10")
def test_two_tensor_parallel_ranks_hold_the_mode() -> None:
    """BI-7, BI-10: at tensor_parallel_size 2 (gloo adds each element's two partial sums once) the needle in random
    crowds gets the same tokens and logits bits as alone in the same engine."""
    with at_threads(2), make(tensor_parallel_size=2) as llm:
        ref = run(llm, [NEEDLES[0][0]], [NEEDLES[0][1]])[0]
        for seed in range(2):
            prompts, params, at = crowd(random.Random(seed), 0, 6)
            assert same(run(llm, prompts, params)[at], ref)
