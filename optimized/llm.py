"""``LLM``: the user's entry point (vLLM conventions) over the engine.

Invariants: a bad constructor argument is a ValueError naming the field,
raised before anything is loaded; ``generate`` validates every request of the
call before adding any (ENG-9), so a refused call changes nothing; it returns
one ``RequestOutput`` per prompt, in prompt order. Unseeded requests get a seed
drawn at add time from the LLM's own generator (``seed``), so a whole run is
reproducible and no request shares another's draws.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from optimized.engine import Engine, EngineLimits, Request, SchedulerConfig, validate_request
from optimized.loader import load_model
from optimized.model_runner import ModelRunner
from optimized.sampling_params import SamplingParams
from optimized.tokenizer import load_tokenizer

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (eos or a stop token) or "length"


def _positive(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return dev


def _dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str | None = None,
        device: str | None = None,
        kvcache_block_size: int = 16,
        num_kvcache_blocks: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.9,
        cpu_kvcache_gib: float = 0.5,
        enforce_eager: bool | None = None,
        check: bool = False,
        attention_backend: str | None = None,
        seed: int = 0,
    ) -> None:
        """Load ``model`` (a checkpoint folder; None: the embedded default model) and size the KV cache.

        ``num_kvcache_blocks`` defaults to what fits a memory budget: ``gpu_memory_utilization`` of the GPU
        (less what weights and activations take) or ``cpu_kvcache_gib`` GiB on the CPU. ``enforce_eager``
        None means CUDA-graph decode on CUDA with a capturable backend, eager everywhere else (ENG-21).
        """
        for name, flag in (("enforce_eager", enforce_eager), ("check", check)):
            if not isinstance(flag, bool) and not (name == "enforce_eager" and flag is None):
                raise ValueError(f"{name} must be a bool, got {flag!r}")
        block_size = _positive("kvcache_block_size", kvcache_block_size, 2)
        _positive("max_num_seqs", max_num_seqs)
        _positive("max_num_batched_tokens", max_num_batched_tokens)
        if num_kvcache_blocks is not None:
            _positive("num_kvcache_blocks", num_kvcache_blocks)
        if not isinstance(gpu_memory_utilization, (int, float)) or not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        if not isinstance(cpu_kvcache_gib, (int, float)) or not cpu_kvcache_gib > 0:
            raise ValueError(f"cpu_kvcache_gib must be a positive number, got {cpu_kvcache_gib!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        dev = _device(device)
        torch_dtype = _dtype(dtype, dev)
        model_dir = self._model_dir(model)
        from kernels.backend import get_backend

        try:
            backend = get_backend(attention_backend, dev)
        except ValueError as e:
            raise ValueError(f"attention_backend: {e}") from None
        if enforce_eager is False and dev.type == "cuda" and backend.name == "torch":
            raise ValueError("enforce_eager=False on CUDA needs attention_backend 'triton' or 'flash-attn'")
        net = load_model(model_dir, torch_dtype, dev)
        c = net.config
        if max_model_len is None:
            max_model_len = c.max_position_embeddings
        _positive("max_model_len", max_model_len, 2)
        if max_model_len > c.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's {c.max_position_embeddings}")
        per_block = ModelRunner.kv_bytes_per_block(net, block_size)
        if num_kvcache_blocks is None:
            num_kvcache_blocks = self._budget_blocks(dev, per_block, gpu_memory_utilization, cpu_kvcache_gib)
        self.model_dir = model_dir
        self.tokenizer = load_tokenizer(model_dir)
        if enforce_eager is None:
            enforce_eager = dev.type != "cuda" or backend.name == "torch"
        self.enforce_eager = enforce_eager
        runner = ModelRunner(
            net,
            backend,
            num_kvcache_blocks,
            block_size,
            max_model_len,
            max_num_seqs=max_num_seqs,
            enforce_eager=enforce_eager,
        )
        config = SchedulerConfig(
            num_blocks=num_kvcache_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            eos=c.eos,
        )
        limits = EngineLimits(c.vocab_size, max_model_len, num_kvcache_blocks, block_size, c.eos_token_ids)
        self.engine = Engine(runner, config, limits, check)
        self._rng = random.Random(seed)

    @staticmethod
    def _model_dir(model: str | Path | None) -> Path:
        if model is None:
            from optimized.default_model import default_model_dir

            return default_model_dir()
        path = Path(model)
        if not path.is_dir():
            raise ValueError(f"model must be a checkpoint folder, got {str(model)!r}")
        return path

    @staticmethod
    def _budget_blocks(dev: torch.device, per_block: int, utilization: float, cpu_gib: float) -> int:
        if dev.type == "cuda":
            free, total = torch.cuda.mem_get_info(dev)
            # What is not free now (weights, other processes) stays taken; a tenth of the rest is left for
            # activations, which the engine does not measure.
            budget = int((total * utilization - (total - free)) * 0.9)
        else:
            budget = int(cpu_gib * (1 << 30))
        blocks = budget // per_block
        if blocks < 1:
            raise ValueError(f"the KV-cache memory budget ({budget} bytes) holds no block of {per_block} bytes")
        return blocks

    def _tokens(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list):
            raise ValueError(f"prompts must be strings or lists of token ids, got {type(prompt).__name__}")
        return prompt

    def generate(
        self,
        prompts: Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; one output per prompt, in order. Refuses the whole call on one bad request."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else sampling_params
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        token_lists = [self._tokens(p) for p in prompts]
        for i, (ids, sp) in enumerate(zip(token_lists, params, strict=True)):
            try:
                validate_request(ids, sp, self.engine.limits)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        requests = [
            self.engine.add(ids, sp, sp.seed if sp.seed is not None else self._rng.getrandbits(63))
            for ids, sp in zip(token_lists, params, strict=True)
        ]
        self._run(requests, use_tqdm)
        return [self._output(r, p if isinstance(p, str) else None) for r, p in zip(requests, prompts, strict=True)]

    def _run(self, requests: list[Request], use_tqdm: bool) -> None:
        from tqdm import tqdm

        pending = {r.arrival for r in requests}
        st = self.engine.stats
        with tqdm(total=len(requests), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while pending:
                done = [r.arrival for r in self.engine.step() if r.arrival in pending]
                pending.difference_update(done)
                if done:
                    bar.update(len(done))
                prefill = st.prefill_tokens / st.prefill_seconds if st.prefill_seconds else 0.0
                decode = st.decode_tokens / st.decode_seconds if st.decode_seconds else 0.0
                bar.set_postfix_str(f"prefill {prefill:.0f} tok/s, decode {decode:.0f} tok/s", refresh=False)

    def _output(self, r: Request, prompt: str | None) -> RequestOutput:
        assert r.finish_reason is not None
        completion = r.seq.completion_token_ids
        return RequestOutput(
            request_id=r.arrival,
            prompt=prompt,
            prompt_token_ids=r.seq.token_ids[: r.seq.num_prompt_tokens],
            token_ids=completion,
            text=self.tokenizer.decode(completion),
            finish_reason=r.finish_reason,
        )
