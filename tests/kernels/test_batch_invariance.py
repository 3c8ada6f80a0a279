"""The batch-invariant kernels (spec/batch-invariance.md): a row of the invariant linear is the same bits alone or in
any batch, at 1 or 2 threads, with denormals flushed or not, on every instruction-set path, and is exactly the order
the spec states; MKL's is not (the negative control); its error against float64 is within 2x MKL's on the models'
shapes; and the C decode attention of a query equals the C prefill's row for the same query and keys. The builds
for other instruction sets are made once per session, each of only the file its tests read."""

from __future__ import annotations

import contextlib
import ctypes
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import cpu_attention, cpu_build, linear
from tests.engine_fixtures import at_threads

ODD = st.integers(0, 40).map(lambda i: 2 * i + 1)


@pytest.fixture(autouse=True)
def _kernel_available() -> None:
    # Only a machine without a C compiler may skip: with one, a kernel that fails to build is a failure here.
    if cpu_build.find_compiler() is None:
        pytest.skip("no C compiler on the PATH")
    reason = cpu_build.unavailable_reason()
    assert reason is None, f"the C kernels did not build: {reason}"


def layer(
    m: int, n: int, k: int, seed: int, bias: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    return x, w, torch.randn(n, generator=g) if bias else None


def rows_alone_differ(
    fn: Callable[..., torch.Tensor], x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> list[int]:
    """The rows of fn(x) that are not bit for bit fn of that row alone."""
    y = fn(x, w, b)
    return [i for i in range(x.shape[0]) if not torch.equal(y[i : i + 1], fn(x[i : i + 1], w, b))]


@pytest.mark.clause("BI-1")
@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 300), n=ODD, k=ODD, seed=st.integers(0, 2**16), two_threads=st.booleans(), data=st.data())
def test_a_row_is_the_same_alone_in_any_batch_at_any_thread_count(
    m: int, n: int, k: int, seed: int, two_threads: bool, data: st.DataObject
) -> None:
    """BI-1: each row of invariant_linear(X) equals invariant_linear(X[i:i+1]) and any slice X[a:b]'s, bit for bit,
    and the whole product is the same at 1 and 2 threads."""
    x, w, b = layer(m, n, k, seed, bias=data.draw(st.booleans()))
    a = data.draw(st.integers(0, m - 1))
    stop = data.draw(st.integers(a + 1, m))
    with at_threads(2 if two_threads else 1):
        assert rows_alone_differ(linear.invariant_linear, x, w, b) == []
        y = linear.invariant_linear(x, w, b)
        assert torch.equal(linear.invariant_linear(x[a:stop], w, b), y[a:stop])
    with at_threads(1 if two_threads else 2):
        assert torch.equal(linear.invariant_linear(x, w, b), y)


NVL_THREAD_WORK = 1 << 20  # cpu_linear.c: a call runs on one thread below twice this many multiply-adds


@pytest.mark.clause("BI-1")
@pytest.mark.parametrize(("m", "n", "k"), [(67, 401, 97), (130, 33, 520), (9, 1537, 256)])
def test_two_threads_really_split_and_give_the_same_bits(m: int, n: int, k: int) -> None:
    """BI-1 at 2 threads: the hypothesis test above draws at most 300 x 81 x 81 multiply-adds, under the work the
    kernel needs before it wakes a second thread, so its thread comparison always runs on one. These shapes (a
    partial last panel, K not a multiple of a block, row counts that split unevenly) are past that work: the
    product at 2 threads equals the one at 1, and each row alone equals its row in the batch."""
    assert 300 * 81 * 81 < 2 * NVL_THREAD_WORK <= m * n * k
    x, w, b = layer(m, n, k, m + n + k)
    with at_threads(1):
        single = linear.invariant_linear(x, w, b)
    with at_threads(2):
        assert torch.equal(linear.invariant_linear(x, w, b), single)
        assert torch.equal(linear.invariant_linear(x[1:], w, b), single[1:])
    assert rows_alone_differ(linear.invariant_linear, x[:3], w, b) == []


@pytest.mark.clause("BI-1")
def test_mkl_is_not_batch_invariant() -> None:
    """BI-1's negative control: F.linear (MKL) on the same inputs gives some row a different value alone than in a
    batch, at 1 thread, so the property above can fail."""
    x, w, b = layer(8, 1536, 256, 0, bias=False)  # the default model's gate_up
    with at_threads(1):
        assert rows_alone_differ(F.linear, x, w, b) != []
        assert rows_alone_differ(linear.invariant_linear, x, w, b) == []


@pytest.mark.clause("BI-1")
@pytest.mark.parametrize("model", sorted(linear.MODEL_SHAPES))
def test_every_layer_of_the_models_is_batch_invariant(model: str) -> None:
    """BI-1 on the real shapes: each linear layer of the default model and of Qwen3-0.6B (its lm_head at 3 rows)
    gives each row the same bits alone, at 1 and 2 threads."""
    for name, (k, n) in linear.MODEL_SHAPES[model].items():
        for m in (3,) if n * k > 1 << 26 else (5, 17):
            x, w, _ = layer(m, n, k, m, bias=False)
            for t in (1, 2):
                with at_threads(t):
                    assert rows_alone_differ(linear.invariant_linear, x, w, None) == [], (name, m, t)


SPECIAL = st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e-30, -3e-38, 1e30, 0.1, 2.0**-24, 3.0])


@pytest.mark.clause("BI-2")
@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 20), n=st.integers(1, 40), k=st.integers(1, 150), seed=st.integers(0, 2**16), data=st.data())
def test_the_kernel_computes_the_stated_order(m: int, n: int, k: int, seed: int, data: st.DataObject) -> None:
    """BI-2: the compiled kernel equals fixed_order_linear (the stated order, each fused multiply-add emulated
    exactly in float64 with torch) bit for bit, on random values and on exact zeros of both signs, ties, tiny and
    huge values; K past one and two blocks, cut into any count of chunks that divides it (the pairwise tree of 3, 5
    or 6 chunks carries an odd one up)."""
    x, w, b = layer(m, n, k, seed, bias=data.draw(st.booleans()))
    chunks = data.draw(st.sampled_from([c for c in range(1, min(k, 8) + 1) if k % c == 0]))
    if data.draw(st.booleans()):
        picks = st.lists(SPECIAL, min_size=m * k, max_size=m * k)
        x = torch.tensor(data.draw(picks), dtype=torch.float32).view(m, k)
    assert torch.equal(linear.compiled_linear(x, w, b, chunks=chunks), linear.fixed_order_linear(x, w, b, chunks))


@pytest.mark.clause("BI-2")
def test_the_stated_order_is_not_one_chain_over_k() -> None:
    """BI-2's control for the test above: the emulation is a real oracle, since the orders near it round otherwise.
    The kernel is the pairwise sum of its blocks of 32 (and so, at K = 256, the same bits as 4 chunks of 2 blocks);
    one chain over all of K, and the blocks' sums added in order instead, each give some output other bits."""
    x, w, _ = layer(16, 24, 256, 5, bias=False)
    kernel = linear.compiled_linear(x, w, None)
    one_chain = torch.zeros(16, 24)
    for j in range(256):
        one_chain = linear._fma_f32(x[:, j, None], w[None, :, j], one_chain)
    blocks = [linear.fixed_order_linear(x[:, a : a + 32], w[:, a : a + 32]) for a in range(0, 256, 32)]
    in_order = blocks[0]
    for b in blocks[1:]:
        in_order = in_order + b
    assert torch.equal(kernel, linear.pairwise_sum(blocks))
    assert torch.equal(kernel, linear.compiled_linear(x, w, None, chunks=4))
    assert not torch.equal(kernel, one_chain)
    assert not torch.equal(kernel, in_order)


@pytest.mark.clause("BI-2")
def test_the_emulated_fma_rounds_once() -> None:
    """BI-2's oracle: _fma_f32 rounds a * b + c once, as fmaf does, where the float64 sum rounded again to float32
    would not: (8 + 2^-20)(8 - 2^-20) + (2^30 + 2^7) is 2^-40 below the midpoint of 2^30 + 2^7 and 2^30 + 2^8, so it
    rounds down; the float64 sum lands on the midpoint and rounds to even, up."""
    a, b, c = (torch.tensor([v]) for v in (8 + 2.0**-20, 8 - 2.0**-20, 2.0**30 + 2.0**7))
    assert (a.double() * b.double() + c.double()).float().item() == 2.0**30 + 2.0**8  # rounded twice
    assert linear._fma_f32(a, b, c).item() == 2.0**30 + 2.0**7
    assert linear._fma_f32(-a, b, -c).item() == -(2.0**30 + 2.0**7)
    assert linear._fma_f32(a, a, torch.zeros(1)).item() == 64 + 2.0**-16  # 2^-40 below float32's reach: dropped


PATH_FLAGS = {"avx2": ("-mno-avx512f",), "portable": ("-mno-avx512f", "-mno-avx2", "-mno-fma")}


def build_for(source: Path, extra: tuple[str, ...], out: Path) -> ctypes.CDLL:
    """``source`` alone, built with the library's flags plus ``extra`` (another instruction set), loaded."""
    compiler = cpu_build.find_compiler()
    assert compiler is not None
    cmd = [compiler, *cpu_build.FLAGS, *extra, "-o", str(out), str(source), *cpu_build.LIBS]
    subprocess.run(cmd, check=True, capture_output=True, timeout=cpu_build.BUILD_TIMEOUT_S)
    return ctypes.CDLL(str(out))


@pytest.fixture(scope="module")
def linear_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ctypes.CDLL]:
    """cpu_linear.c built once per session for each path this machine's build does not take."""
    folder = tmp_path_factory.mktemp("linear-paths")
    return {path: build_for(cpu_build.LINEAR_SOURCE, extra, folder / f"{path}.so")
            for path, extra in PATH_FLAGS.items()}  # fmt: skip


@pytest.mark.clause("BI-2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_instruction_set_path_gives_the_same_bits(
    linear_paths: dict[str, ctypes.CDLL], dtype: torch.dtype
) -> None:
    """BI-2, BI-6: cpu_linear.c built for AVX2 and for no vector extension at all (the fallbacks of machines without
    AVX-512) gives the very bits of this machine's build, float32 and float64."""
    cases = []
    for m, n, k in ((1, 5, 3), (4, 16, 16), (7, 33, 47), (300, 21, 99)):
        x, w, b = layer(m, n, k, m + n + k)
        assert b is not None
        cases.append((x.to(dtype), w.to(dtype), b.to(dtype)))
    expected = [linear.compiled_linear(*case) for case in cases]
    for path, library in linear_paths.items():
        named = library.nv_linear_path
        named.restype = ctypes.c_char_p
        assert named() == path.encode()
        kernel = linear.bind(library, dtype)
        for case, want in zip(cases, expected, strict=True):
            assert torch.equal(linear.compiled_linear(*case, kernel=kernel), want), (path, case[0].shape)


def silu_mul_of(library: ctypes.CDLL) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """``nv_silu_mul_f32`` of a build, called as ``linear.invariant_silu_mul`` calls it."""
    fn = library.nv_silu_mul_f32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_int64]  # fmt: skip

    def call(gu: torch.Tensor, width: int) -> torch.Tensor:
        out = torch.empty(gu.shape[0], width)
        fn(gu.data_ptr(), gu.stride(0), out.data_ptr(), width, gu.shape[0], width, 1)
        return out

    return call


def silu_inputs() -> torch.Tensor:
    """Gates over SiLU's whole range (every regime of the kernel's exp, its clamps, signed zeros, inf and NaN)."""
    g = torch.cat([torch.linspace(-120, 120, 40001), torch.randn(4000) * 4,
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.37, -88.37, -88.4, 87.0, -87.0, torch.inf, -torch.inf,
                                 torch.nan])])  # fmt: skip
    return g


@pytest.mark.clause("BI-8")
def test_every_instruction_set_path_gives_the_same_silu_bits(linear_paths: dict[str, ctypes.CDLL]) -> None:
    """BI-8: the mode's SiLU times up, built for AVX2 and for no vector extension at all, gives the very bits of this
    machine's build (NaN's too), on rows whose width is and is not a multiple of the vector (the tail's padded
    copy)."""
    g = silu_inputs()
    for width in (g.numel(), 129, 16, 3):
        gu = torch.cat([g[:width], torch.randn(width)]).view(1, -1).repeat(2, 1)
        want = linear.invariant_silu_mul(gu, width)
        for path, library in linear_paths.items():
            assert torch.equal(silu_mul_of(library)(gu, width).view(torch.int32), want.view(torch.int32)), (path, width)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many float32 values lie between a and b (their ordered bit patterns' distance)."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.view(torch.int32).long()
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)

    return (ordered(a) - ordered(b)).abs()


@pytest.mark.clause("BI-8")
def test_the_invariant_silu_is_as_accurate_as_torchs() -> None:
    """BI-8: the C SiLU (Cephes' expf) is within 2 units in the last place of the correctly rounded g / (1 + e^-g)
    wherever that is above 1e-30 in size, as torch's own forms are; 0, +-inf and NaN give what torch's form gives,
    and the product with up is one more rounding. A gate_up that does not fit is a ValueError naming it."""
    g = silu_inputs()
    up = torch.randn(g.numel())
    mine = linear.invariant_silu_mul(torch.cat([g, torch.ones_like(g)]).view(1, -1), g.numel())[0]
    exact = (g.double() / (1 + torch.exp(-g.double()))).float()
    torch_form = g / (1 + torch.exp(-g))
    sized = exact.abs() > 1e-30
    assert int(ulps_apart(mine[sized], exact[sized]).max()) <= 2
    assert int(ulps_apart(torch_form[sized], exact[sized]).max()) <= 2
    special = ~torch.isfinite(g) | (g == 0)
    assert torch.equal(mine[special].nan_to_num(7.0), torch_form[special].nan_to_num(7.0))
    assert torch.equal(torch.copysign(torch.ones(int(special.sum())), mine[special]),
                       torch.copysign(torch.ones(int(special.sum())), torch_form[special]))  # fmt: skip
    times_up = linear.invariant_silu_mul(torch.cat([g, up]).view(1, -1), g.numel())[0]
    assert torch.equal(times_up.view(torch.int32), (mine * up).view(torch.int32))
    with pytest.raises(ValueError, match=r"gate_up torch\.float64"):
        linear.invariant_silu_mul(torch.zeros(2, 8, dtype=torch.float64), 4)
    with pytest.raises(ValueError, match=r"gate_up .* \(2, 7\) .* is not \[\*, 2 \* 4\]"):
        linear.invariant_silu_mul(torch.zeros(2, 7), 4)


@pytest.mark.clause("BI-3")
@pytest.mark.parametrize("model", sorted(linear.MODEL_SHAPES))
def test_error_against_float64_is_within_twice_mkls(model: str) -> None:
    """BI-3: on every linear layer of the default model and Qwen3-0.6B, the kernel's largest error against the
    float64 layer is at most 2x F.linear's (measured: 0.3x to 1.1x)."""
    for name, (k, n) in linear.MODEL_SHAPES[model].items():
        m = 2 if n * k > 1 << 26 else 33
        x, w, _ = layer(m, n, k, 7)
        exact = linear.float64_linear(x, w)
        mine = linear.relative_error(linear.invariant_linear(x, w), exact)
        mkl = linear.relative_error(F.linear(x, w), exact)
        assert mine <= 2 * mkl, (name, mine, mkl)


@contextlib.contextmanager
def flushing_denormals(warm: Callable[[], object]) -> Iterator[None]:
    """The calling thread with flush-to-zero and denormals-are-zero on (torch.set_flush_denormal), off again after.
    ``warm`` runs first at 2 threads, so OpenMP's worker exists before: a thread started later would inherit the
    caller's flags, and the test could not fail."""
    with at_threads(2):
        warm()
    assert torch.set_flush_denormal(True), "this CPU cannot flush denormals"
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


@pytest.mark.clause("BI-2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_flushed_denormals_change_no_row(dtype: torch.dtype) -> None:
    """BI-2: with flush-to-zero and denormals-are-zero on in the calling thread (which OpenMP's workers do not
    inherit), every thread computes in the caller's environment: products in the denormal range give each row the
    same bits alone as in the batch, and at 1 thread as at 2 (before, every row differed)."""
    g = torch.Generator().manual_seed(0)
    tiny = 1e-20 if dtype == torch.float32 else 1e-155
    m = 256  # 256 * 256 * 64 multiply-adds: enough work for 2 threads (NVL_THREAD_WORK)
    x = (torch.rand(m, 64, generator=g, dtype=torch.float64) * tiny).to(dtype)
    w = (torch.rand(m, 64, generator=g, dtype=torch.float64) * tiny * 10).to(dtype)
    with flushing_denormals(lambda: linear.invariant_linear(x, w)):
        with at_threads(2):
            batch = linear.invariant_linear(x, w)
            alone = [linear.invariant_linear(x[i : i + 1], w) for i in range(m)]
        with at_threads(1):
            single = linear.invariant_linear(x, w)
    # Compared with denormals read as such again (a comparison under DAZ would call every denormal 0).
    assert [i for i in range(m) if not torch.equal(batch[i : i + 1], alone[i])] == []
    assert torch.equal(batch, single)
    assert torch.equal(batch, torch.zeros_like(batch))  # every product flushed, as the caller asked


@pytest.mark.clause("BI-2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_chain_starts_from_plus_zero(dtype: torch.dtype) -> None:
    """BI-2's signed zeros: each block's chain starts from +0, in float32 and float64 alike. Products that are exactly
    -0 (every x = 0, w = -1) then give +0 (-0 + +0 is +0; a chain started from -0, or from its first product, would
    stay -0), while products that underflow keep the chain at -0 (every x = -tiny, w = tiny: the fused multiply-add
    rounds the exact, nonzero sum), and -0 sums add to -0 across blocks and chunks. The emulation agrees."""
    tiny = 1e-30 if dtype == torch.float32 else 1e-200
    for k, chunks in ((1, 1), (17, 1), (64, 1), (65, 1), (200, 1), (200, 4), (96, 3)):
        for xv, wv, sign in ((0.0, -1.0, 1.0), (-tiny, tiny, -1.0)):
            x, w = torch.full((3, k), xv, dtype=dtype), torch.full((2, k), wv, dtype=dtype)
            y = linear.invariant_linear(x, w, None, chunks)
            signs = torch.copysign(torch.ones_like(y), y)
            assert torch.equal(y, torch.zeros(3, 2, dtype=dtype)) and bool((signs == sign).all()), (k, chunks, xv, y)
            if dtype == torch.float32:
                emulated = linear.fixed_order_linear(x, w, None, chunks)
                assert torch.equal(torch.copysign(torch.ones_like(y), emulated), signs)


@pytest.mark.clause("BI-5")
def test_no_in_features_give_the_bias() -> None:
    """BI-5: in_features 0 (an empty sum) gives +0 + bias, as F.linear gives the bias, through every entry point and
    in both dtypes, never a reshape error."""
    for dtype in (torch.float32, torch.float64):
        x, w, b = torch.randn(3, 0, dtype=dtype), torch.randn(5, 0, dtype=dtype), torch.randn(5, dtype=dtype)
        def bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            return linear.BoundLinear(w, b)(x)

        entries: list[Callable[..., torch.Tensor]] = [linear.invariant_linear, bound]
        for fn in entries + ([linear.fixed_order_linear] if dtype == torch.float32 else []):
            assert torch.equal(fn(x, w, b), F.linear(x, w, b))
            assert torch.equal(fn(x, w, None), torch.zeros(3, 5, dtype=dtype))
            assert fn(torch.randn(2, 4, 0, dtype=dtype), w, b).shape == (2, 4, 5)


@pytest.mark.clause("BI-5")
def test_refusals_name_the_tensor() -> None:
    """BI-5: a tensor the invariant linear cannot take is a ValueError naming it, never a silent F.linear."""
    x, w, b = layer(2, 3, 4, 0)
    assert b is not None
    with pytest.raises(ValueError, match=r"weight is torch\.float32: the invariant linear takes float32 or float64"):
        linear.invariant_linear(x.double(), w, b)
    with pytest.raises(ValueError, match=r"x is torch\.bfloat16"):
        linear.invariant_linear(x.bfloat16(), w.bfloat16(), b.bfloat16())
    with pytest.raises(ValueError, match="x's last dimension 5 is not weight's in_features 4"):
        linear.invariant_linear(torch.zeros(2, 5), w, b)
    with pytest.raises(ValueError, match=r"bias \(2,\) is not \[out_features\]"):
        linear.invariant_linear(x, w, b[:2])
    with pytest.raises(ValueError, match=r"weight .* is not"):
        linear.invariant_linear(x, w[0], None)
    with pytest.raises(ValueError, match="x is on meta"):
        linear.invariant_linear(x.to("meta"), w, b)


@pytest.mark.clause("BI-5")
def test_without_the_library_the_torch_order_stands_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """BI-5: where the library does not build, invariant_linear computes the same bits with torch (never MKL); strided
    inputs and leading batch dimensions are taken as F.linear takes them."""
    x, w, b = layer(6, 9, 20, 3)
    xs = torch.randn(2, 6, 40)[..., ::2]  # strided along in_features
    want, want_strided = linear.invariant_linear(x, w, b), linear.invariant_linear(xs, w, b)
    assert want_strided.shape == (2, 6, 9)
    assert torch.equal(want_strided.reshape(12, 9), linear.invariant_linear(xs.reshape(12, 20).contiguous(), w, b))
    monkeypatch.setattr(linear, "unavailable_reason", lambda: "no C compiler (a test)")
    assert torch.equal(linear.invariant_linear(x, w, b), want)
    assert torch.equal(linear.invariant_linear(xs, w, b), want_strided)


def attention_case(
    seed: int, n: int, qlen: int, heads: int, kv_heads: int, d: int, block: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    blocks = -(-n // block) + 2
    k_cache = torch.randn(blocks, block, kv_heads, d, generator=g, dtype=dtype) * 3
    v_cache = torch.randn(blocks, block, kv_heads, d, generator=g, dtype=dtype)
    table = torch.randperm(blocks, generator=g)[None].to(torch.int32)
    q = torch.randn(qlen, heads, d, generator=g, dtype=dtype)
    return q, k_cache, v_cache, table


@pytest.mark.clause("BI-4")
@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(1, 80),
    gqa=st.sampled_from([(1, 1), (4, 2), (6, 2), (8, 1)]),
    d=st.sampled_from([64, 128, 8, 20, 33]),
    block=st.sampled_from([1, 4, 16]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    data=st.data(),
)
def test_decode_row_equals_prefill_row(
    seed: int, n: int, gqa: tuple[int, int], d: int, block: int, dtype: torch.dtype, data: st.DataObject
) -> None:
    """BI-4: for the same query and keys, the C decode's output is the C prefill's row for that query, bit for bit:
    a prefill of the last qlen positions of a context against decodes of each one with its own context length (so
    recomputing a preempted sequence, or reading blocks decode wrote, moves no bit)."""
    qlen = data.draw(st.integers(1, n))
    q, k_cache, v_cache, table = attention_case(seed, n, qlen, *gqa, d, block, dtype)
    scale = d**-0.5
    cu = torch.tensor([0, qlen], dtype=torch.int32)
    prefill = cpu_attention.paged_prefill(q, k_cache, v_cache, cu, torch.tensor([n], dtype=torch.int32), table, scale)
    lens = torch.arange(n - qlen + 1, n + 1, dtype=torch.int32)
    decode = cpu_attention.paged_decode(q, k_cache, v_cache, lens, table.expand(qlen, -1).contiguous(), scale)
    assert torch.equal(decode, prefill)


def decode_and_prefill(
    case: tuple[torch.Tensor, ...], n: int, library: ctypes.CDLL | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The C decode of each query of ``case`` (the last qlen positions of an n-token context) with its own context
    length, and the C prefill of them all."""
    q, k_cache, v_cache, table = case
    qlen, scale = q.shape[0], q.shape[2] ** -0.5
    cu, lens = torch.tensor([0, qlen], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    prefill = cpu_attention.paged_prefill(q, k_cache, v_cache, cu, lens, table, scale, library=library)
    own = torch.arange(n - qlen + 1, n + 1, dtype=torch.int32)
    rows = table.expand(qlen, -1).contiguous()
    return cpu_attention.paged_decode(q, k_cache, v_cache, own, rows, scale, library=library), prefill


# (n, GQA, head dim, block size): prompts of many KV blocks, n a multiple of neither 16 nor the block size; the
# default model's and Qwen3-0.6B's heads, and a head dim the prefill's vector loops do not divide.
LONG_PROMPTS = [(301, (4, 2), 64, 16), (200, (16, 8), 128, 7), (151, (6, 2), 72, 5)]


@pytest.mark.clause("BI-4")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("n", "gqa", "d", "block"), LONG_PROMPTS)
def test_decode_row_equals_prefill_row_at_every_position(
    n: int, gqa: tuple[int, int], d: int, block: int, dtype: torch.dtype
) -> None:
    """BI-4: at every position of a long prompt, and of a later chunk of it, the C decode's row is the C prefill's,
    bit for bit, across KV block boundaries, at 1 and 2 threads."""
    for qlen in (n, n // 3 + 1):
        case = attention_case(n + qlen, n, qlen, *gqa, d, block, dtype)
        for threads in (1, 2):
            with at_threads(threads):
                decode, prefill = decode_and_prefill(case, n)
            differ = (decode != prefill).any(dim=2).any(dim=1).nonzero().flatten().tolist()
            assert differ == [], (qlen, threads, f"positions {[n - qlen + i for i in differ][:8]}")


# Builds of cpu_attention.c for the machines without AVX-512 (AVX2) and without AVX at all, with the prefill's
# vector width in bytes that each must report.
ATTENTION_PATHS = {"avx2": (("-mno-avx512f",), 32), "sse": (("-mno-avx512f", "-mno-avx"), 16)}


@pytest.fixture(scope="module")
def attention_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ctypes.CDLL]:
    """cpu_attention.c built once per session for AVX2 and for SSE alone."""
    folder = tmp_path_factory.mktemp("attention-paths")
    return {path: build_for(cpu_build.SOURCE, extra, folder / f"{path}.so")
            for path, (extra, _) in ATTENTION_PATHS.items()}  # fmt: skip


@pytest.mark.clause("BI-4")
def test_every_instruction_set_path_gives_the_same_attention_bits(attention_paths: dict[str, ctypes.CDLL]) -> None:
    """BI-4: cpu_attention.c built for AVX2 and for SSE alone (the prefill's vectors a half and a quarter of AVX-512's)
    gives this machine's decode bits, from its decode and from its prefill alike."""
    cases = [
        (attention_case(seed, n, qlen, *gqa, d, block, dtype), n)
        for seed, (n, gqa, d, block) in enumerate([(75, (4, 2), 64, 16), (40, (2, 1), 128, 3), (29, (3, 1), 20, 4)])
        for qlen in (n, 9)
        for dtype in (torch.float32, torch.float64)
    ]
    expected = [decode_and_prefill(case, n)[0] for case, n in cases]
    for path, (_, vector_bytes) in ATTENTION_PATHS.items():
        library = attention_paths[path]
        width = library.nv_attention_vector_bytes
        width.restype = ctypes.c_int64
        assert width() == vector_bytes, path
        for (case, n), want in zip(cases, expected, strict=True):
            decode, prefill = decode_and_prefill(case, n, library)
            assert torch.equal(decode, want), (path, "decode", case[0].shape, case[0].dtype)
            assert torch.equal(prefill, want), (path, "prefill", case[0].shape, case[0].dtype)


@pytest.mark.clause("BI-4")
def test_flushed_denormals_change_no_attention_bit() -> None:
    """BI-4, KERN-26: with flush-to-zero and denormals-are-zero on in the calling thread, every thread of the C
    attention computes in the caller's environment: values in the denormal range give the prefill the same bits at
    1 and 2 threads, and the decode's (before, the KV head a worker took kept its denormals)."""
    g = torch.Generator().manual_seed(0)
    rows, n = 16, 300
    blocks = n // 16 + 1
    q = torch.randn(rows, 4, 64, generator=g)
    k_cache = torch.randn(blocks, 16, 2, 64, generator=g)
    v_cache = torch.rand(blocks, 16, 2, 64, generator=g) * 1e-39
    table = torch.arange(blocks, dtype=torch.int32)[None]
    cu, lens = torch.tensor([0, rows], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    own, tables = torch.arange(n - rows + 1, n + 1, dtype=torch.int32), table.expand(rows, -1).contiguous()

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        decode = cpu_attention.paged_decode(q, k_cache, v_cache, own, tables, 0.125)
        return decode, cpu_attention.paged_prefill(q, k_cache, v_cache, cu, lens, table, 0.125)

    with flushing_denormals(both):
        with at_threads(2):
            decode2, prefill2 = both()
        with at_threads(1):
            decode1, prefill1 = both()
    assert torch.equal(prefill2, prefill1)
    assert torch.equal(decode2, decode1)
    assert torch.equal(decode2, prefill2)
    assert torch.equal(prefill2, torch.zeros_like(prefill2))  # every denormal read as 0, as the caller asked


@pytest.mark.clause("BI-2")
def test_the_librarys_key_covers_every_header_the_linear_includes(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """BI-2's kernel is cpu_linear.c and the tile header it includes: every file it includes by quotes is hashed
    into the cached library's name (a changed tile with the old name would load the old, stale library), and the
    name changes when the header's bytes change."""
    included = {line.split('"')[1] for line in cpu_build.LINEAR_SOURCE.read_text(encoding="utf-8").splitlines()
                if line.startswith("#include \"")}  # fmt: skip
    assert included and included <= {h.name for h in cpu_build.HEADERS}
    compiler = cpu_build.find_compiler()
    assert compiler is not None
    before = cpu_build.library_path(compiler)
    changed = tmp_path / "cpu_linear_tile.h"
    changed.write_bytes(cpu_build.HEADERS[0].read_bytes() + b"\n/* changed */\n")
    monkeypatch.setattr(cpu_build, "HEADERS", (changed,))
    assert cpu_build.library_path(compiler) != before
