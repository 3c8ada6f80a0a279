"""The shapes, workloads and time budgets of ``nanoverify gpu-check``: the full GPU profile and its tiny CPU twin.

Invariants: both profiles name the same stages in the same order with the same meaning; only sizes, dtypes and
budgets differ, so a tiny run on the CPU exercises every line of the pipeline the GPU run uses. The bench model
of the GPU profile is Qwen3-0.6B's shape (hidden 1024, 28 layers, 16 heads, 8 KV heads, head dim 128,
intermediate 3072, vocab 151936, tied embeddings) and its workload is nano-vllm's bench.py workload (256
requests, prompt and output lengths uniform in 100..1024, eos ignored). Budgets are wall-clock seconds per stage;
``deadline_s`` bounds the whole run, so a slow stage shortens the later ones instead of overrunning.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """A Qwen3 decoder's dimensions; ``config()`` is its config.json."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_embeddings: bool
    max_position: int = 4096

    def config(self, torch_dtype: str) -> dict[str, Any]:
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "attention_bias": False,
            "tie_word_embeddings": self.tie_embeddings,
            "bos_token_id": None,
            # Random weights: an eos exists so the engine's stop logic is live, but every request ignores it.
            "eos_token_id": self.vocab - 1,
            "torch_dtype": torch_dtype,
        }


@dataclass(frozen=True)
class BenchWorkload:
    """``num_requests`` prompts of uniform length in [min_len, max_len], outputs likewise (nano-vllm bench.py)."""

    num_requests: int
    min_len: int
    max_len: int
    seed: int = 0


@dataclass(frozen=True)
class Profile:
    name: str
    device: str  # "cuda" or "cpu"
    bench_dtype: str  # the bench checkpoint's dtype
    exact_dtype: str  # eager-vs-graphs runs in this dtype (float32: a flipped argmax means a real difference)
    bench_model: ModelShape
    exact_model: ModelShape
    workload: BenchWorkload
    hf_requests: int  # transformers serves the first hf_requests of the workload...
    hf_batch: int  # ...in static batches of this size
    exact_batches: tuple[int, ...]  # eager and graphs compared at each of these batch sizes
    exact_max_tokens: int
    floor_batch: int  # decode steps timed at this batch size
    floor_steps: int
    floor_warmup_steps: int
    copy_bytes: int  # the tensor copied to measure bandwidth
    kernel_pytest_args: tuple[str, ...]  # what pytest runs: a path first, then any selection (a subset on the CPU)
    kernel_pytest_note: str
    invariant_pytest_args: tuple[str, ...]  # the kernels-invariant stage's pytest selection (GPU-4)
    budgets: dict[str, float]
    deadline_s: float


STAGES = ("kernels", "kernels-direct", "kernels-invariant", "graphs-exact", "checkpoint", "engine-graphs",
          "engine-eager", "transformers", "decode-floor")

QWEN3_0_6B = ModelShape(
    hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151936, tie_embeddings=True
)

GPU = Profile(
    name="gpu",
    device="cuda",
    bench_dtype="bfloat16",
    exact_dtype="float32",
    bench_model=QWEN3_0_6B,
    exact_model=ModelShape(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=768, vocab=1024,
                           tie_embeddings=False),
    workload=BenchWorkload(num_requests=256, min_len=100, max_len=1024),
    hf_requests=64,
    hf_batch=64,
    exact_batches=(1, 3, 8, 17, 64),
    exact_max_tokens=32,
    floor_batch=256,
    floor_steps=16,
    floor_warmup_steps=4,
    copy_bytes=2 << 30,
    kernel_pytest_args=("tests/kernels", "--ignore=tests/kernels/test_triton_invariance.py"),
    kernel_pytest_note="full suite (its batch-invariance file in kernels-invariant)",
    invariant_pytest_args=("tests/kernels/test_triton_invariance.py",),
    budgets={"kernels": 150, "kernels-direct": 60, "kernels-invariant": 90, "graphs-exact": 60, "checkpoint": 45,
             "engine-graphs": 90, "engine-eager": 110, "transformers": 90, "decode-floor": 75},
    deadline_s=440,
)

TINY = Profile(
    name="tiny",
    device="cpu",
    bench_dtype="float32",
    exact_dtype="float32",
    bench_model=ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=384,
                           tie_embeddings=True, max_position=256),
    exact_model=ModelShape(hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, intermediate=64, vocab=300,
                           tie_embeddings=False, max_position=256),
    workload=BenchWorkload(num_requests=8, min_len=4, max_len=16),
    hf_requests=6,
    hf_batch=3,
    exact_batches=(1, 3),
    exact_max_tokens=6,
    floor_batch=8,
    floor_steps=4,
    floor_warmup_steps=1,
    copy_bytes=32 << 20,
    kernel_pytest_args=("tests/kernels/test_kernels_attention.py", "-k", "store_kv"),
    kernel_pytest_note="interpreter subset: store_kv tests (CI's pytest runs the whole suite interpreted)",
    invariant_pytest_args=("tests/kernels/test_triton_invariance.py", "-k", "float32_bound or refuses"),
    budgets={"kernels": 40, "kernels-direct": 40, "kernels-invariant": 60, "graphs-exact": 30, "checkpoint": 20,
             "engine-graphs": 30, "engine-eager": 30, "transformers": 30, "decode-floor": 30},
    deadline_s=180,
)

PROFILES = {"gpu": GPU, "tiny": TINY}


def profile_for(tiny: bool, device: str) -> Profile:
    """The tiny shapes when asked (on either device), else the full GPU profile, which needs CUDA."""
    if tiny:
        return replace(TINY, device=device)
    if device != "cuda":
        raise ValueError("device: the full profile needs 'cuda'; use --device cpu --tiny for the CPU dry run")
    return GPU
