"""``nanoverify bench throughput``: the engine against transformers' ``generate`` on one workload, in one run.

Both sides get the same model folder, dtype, device, CPU thread count (``torch.set_num_threads`` once, before either
runs) and requests: random prompts of 1..max_input_len tokens, each asking for 1..max_output_len tokens, greedy, eos
ignored (the engine by ``ignore_eos``; transformers by a generation config without an eos), so every request
produces exactly its length on both sides. The engine takes them all at once (continuous batching, check mode off,
its default ``enforce_eager`` and attention backend, which its line names); transformers takes them in static
batches of ``hf_batch_size`` in arrival order, left-padded, each batch generating exactly its longest request's
length. Throughput counts only requested output tokens on both sides, so padding and over-generation in static
batches are transformers' cost, as they are in practice. Each side first serves the same small warm-up workload,
untimed. Wall-clock time is the measure; each side's process CPU time is printed beside it, because on a shared
machine a neighbour's load moves wall time between the two runs. As a check that both did the same work, the run
reports how many requests got the same tokens from both (float32 rounding differs between the engine's attention and
transformers' SDPA, so a near-tie can rarely flip a greedy choice).

With ``--tensor-parallel-size N`` (N > 1) the two sides are the engine at TP=1 and at TP=N instead (spec/parallel.md,
TP-10): TP=1 with the run's thread count, each of the N ranks with that count divided by N (at least one), so both
use the same cores; the TP=N line adds rank 0's communication per step (all-reduces, their bytes and time).

With ``--compare-batch-invariant`` the two sides are the engine with the batch-invariant mode off and on
(spec/batch-invariance.md, BI-10): two engines of the same settings, each warmed, then timed in alternation, the
order swapped each round (off then on, on then off, ...; ``INVARIANT_ROUNDS`` each) so that neither always runs
first and a neighbour's load falls on both; each round's wall and CPU seconds are printed, then both medians and their
ratio, and how many requests got the same tokens from both. With ``--with-transformers`` transformers' ``generate``
serves the workload too, once, after the rounds, and the mode-on engine's median is set against it (wall and CPU).

The engine's settings are ``EngineArgs`` (every engine flag; its seed seeds the workload too); the workload's are
the command's own flags, ``DEFAULTS`` filling those not given.
"""

from __future__ import annotations

import argparse
import copy
import random
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from optimized.core.errors import is_strict_int
from optimized.engine.arg_types import MAX_COUNT, MAX_THREADS
from optimized.engine.args import EngineArgs
from optimized.engine.assembly import torch_dtype
from optimized.engine.sampling_params import SamplingParams
from optimized.entry.llm import LLM

DEFAULTS: dict[str, Any] = {
    "num_requests": 256,
    "max_input_len": 256,
    "max_output_len": 128,
    "hf_batch_size": 32,
    "threads": None,
}


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_requests: int, max_input_len: int, max_output_len: int, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, max_input_len))] for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(1, max_output_len) for _ in range(num_requests)])


def _params(w: Workload) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in w.output_lens]


@dataclass(frozen=True)
class Timing:
    wall: float  # seconds, the measure
    cpu: float  # this process's CPU seconds over the same span (on a shared machine, less sensitive to neighbours)


class _Clock:
    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def stop(self) -> Timing:
        return Timing(time.perf_counter() - self.wall, time.process_time() - self.cpu)


def run_engine(llm: LLM, w: Workload, warmup: Workload) -> tuple[Timing, list[list[int]]]:
    """Time for the engine to serve the whole workload (after serving ``warmup``), and its outputs."""
    llm.generate(warmup.prompts, _params(warmup), use_tqdm=False)
    params = _params(w)
    clock = _Clock()
    outs = llm.generate(w.prompts, params, use_tqdm=False)
    timing = clock.stop()
    tokens = [o.token_ids for o in outs]
    assert [len(t) for t in tokens] == w.output_lens
    return timing, tokens


def _hf_batch(model: Any, prompts: list[list[int]], new_tokens: int, device: torch.device) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    config = copy.deepcopy(model.generation_config)
    # No eos: every row generates exactly new_tokens tokens, as the engine's requests ignore eos.
    config.eos_token_id = None
    config.do_sample = False
    config.max_new_tokens = new_tokens
    config.pad_token_id = 0
    out = model.generate(ids, attention_mask=mask, generation_config=config)
    assert out.shape[1] == width + new_tokens
    generated: list[list[int]] = out[:, width:].tolist()
    return generated


def run_transformers(
    model_dir: str, dtype: torch.dtype, device: torch.device, w: Workload, batch: int, warmup: Workload
) -> tuple[Timing, list[list[int]], str]:
    """Time for transformers to serve the workload in static batches, its outputs (requested lengths) and its
    attention implementation."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.to(device)
    model.train(False)
    outputs: list[list[int]] = []
    with torch.inference_mode():
        _hf_batch(model, warmup.prompts, max(warmup.output_lens), device)
        clock = _Clock()
        for i in range(0, len(w.prompts), batch):
            rows = _hf_batch(model, w.prompts[i : i + batch], max(w.output_lens[i : i + batch]), device)
            outputs += [r[:n] for r, n in zip(rows, w.output_lens[i : i + batch], strict=True)]
        if device.type == "cuda":
            torch.cuda.synchronize()
        timing = clock.stop()
    return timing, outputs, str(model.config._attn_implementation)


def _arg(args: argparse.Namespace, name: str) -> Any:
    value = getattr(args, name, None)
    return DEFAULTS[name] if value is None else value


def check_arguments(args: argparse.Namespace) -> None:
    """ValueError naming the first setting out of range, before anything is loaded or set.

    The command line refuses these at parse time already (optimized/cli/bench.py); this is the same rule for
    a caller that builds the Namespace itself.
    """
    for name in ("num_requests", "max_input_len", "max_output_len", "hf_batch_size", "threads"):
        value = _arg(args, name)
        if value is None and name == "threads":
            continue
        most = MAX_THREADS if name == "threads" else MAX_COUNT
        if not is_strict_int(value) or not 1 <= value <= most:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer in [1, {most}], got {value!r}")


def _tp_line(llm: LLM, timing: Timing, w: Workload, size: int, threads: int, steps: int) -> str:
    c = llm.comm_stats()
    assert c is not None  # a tensor-parallel LLM's
    steps = max(1, steps)
    per = c.all_reduce_seconds / max(1, c.all_reduces) * 1e6
    gathered = c.gather_bytes / max(1, c.gathers) / 1024
    return (
        f"nanoverify engine TP={size}:     {w.output_tokens / timing.wall:10.1f} output tok/s ({timing.wall:.2f} s, "
        f"{timing.cpu:.2f} rank-0 CPU s, {threads} thread(s) per rank); per step on rank 0: "
        f"{c.all_reduces / steps:.1f} all-reduces of {c.all_reduce_bytes / max(1, c.all_reduces) / 1024:.1f} KiB "
        f"on average, {per:.0f} us each as rank 0 waits (skew included; "
        f"{c.all_reduce_seconds / timing.wall:.0%} of the wall time), logits gathered {gathered:.1f} KiB per step"
    )


def _check_lengths(llm: LLM, max_in: int, max_out: int) -> None:
    if max_in + max_out > llm.limits.max_model_len:
        raise ValueError(f"--max-input-len {max_in} + --max-output-len {max_out} exceeds the model's "
                         f"max_model_len={llm.limits.max_model_len}")


def compare_tensor_parallel(args: argparse.Namespace, engine: EngineArgs, threads: int) -> int:
    """TP-10: the engine at TP=1 and at TP=``engine.tensor_parallel_size`` on one workload, side by side."""
    size = engine.tensor_parallel_size
    num, max_in, max_out = (_arg(args, k) for k in ("num_requests", "max_input_len", "max_output_len"))
    one = LLM(**replace(engine, tensor_parallel_size=1).as_kwargs())
    _check_lengths(one, max_in, max_out)
    w = make_workload(num, max_in, max_out, one.limits.vocab_size, engine.seed)
    warmup = make_workload(4, max_in, 4, one.limits.vocab_size, engine.seed + 1)
    print(f"workload: {num} requests, prompts 1..{max_in}, outputs 1..{max_out} tokens ({w.output_tokens} output "
          f"tokens, greedy, eos ignored), model {one.model_dir}, {one.settings.dtype} on {one.settings.device}; "
          f"untimed warm-up of {len(warmup.prompts)} requests on both sides")
    single, single_out = run_engine(one, w, warmup)
    print(f"nanoverify engine TP=1:     {w.output_tokens / single.wall:10.1f} output tok/s ({single.wall:.2f} s, "
          f"{single.cpu:.2f} CPU s, {threads} thread(s))")
    del one
    per_rank = max(1, threads // size)
    with LLM(**engine.as_kwargs()) as many:  # workers: threads // size
        torch.set_num_threads(per_rank)
        many.generate(warmup.prompts, _params(warmup), use_tqdm=False)
        many.reset_comm_stats()  # the timed run's communication only
        steps = many.stats.steps
        split, split_out = run_engine(many, w, Workload([], []))
        print(_tp_line(many, split, w, size, per_rank, many.stats.steps - steps))
    same = sum(a == b for a, b in zip(single_out, split_out, strict=True))
    print(f"requests with identical tokens on both sides: {same}/{len(w.prompts)}")
    print(f"ratio (TP={size} / TP=1): {single.wall / split.wall:.2f}x")
    return 0


INVARIANT_ROUNDS = 3


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def compare_batch_invariant(args: argparse.Namespace, engine: EngineArgs, threads: int) -> int:
    """BI-10: the engine with the batch-invariant mode off and on, on one workload, alternating."""
    num, max_in, max_out = (_arg(args, k) for k in ("num_requests", "max_input_len", "max_output_len"))
    sides = {on: LLM(**replace(engine, batch_invariant=on).as_kwargs()) for on in (False, True)}
    off = sides[False]
    _check_lengths(off, max_in, max_out)
    w = make_workload(num, max_in, max_out, off.limits.vocab_size, engine.seed)
    warmup = make_workload(4, max_in, 4, off.limits.vocab_size, engine.seed + 1)
    print(f"workload: {num} requests, prompts 1..{max_in}, outputs 1..{max_out} tokens ({w.output_tokens} output "
          f"tokens, greedy, eos ignored), model {off.model_dir}, {off.settings.dtype} on {off.settings.device}, "
          f"{threads} torch threads, {off.settings.attention_backend} attention backend; batch-invariant mode off "
          f"and on, alternating, {INVARIANT_ROUNDS} timed rounds each after an untimed warm-up")
    times: dict[bool, list[Timing]] = {False: [], True: []}
    outputs: dict[bool, list[list[int]]] = {}
    for llm in sides.values():
        llm.generate(warmup.prompts, _params(warmup), use_tqdm=False)
    for r in range(INVARIANT_ROUNDS):
        for on in (False, True) if r % 2 == 0 else (True, False):
            timing, outputs[on] = run_engine(sides[on], w, Workload([], []))
            times[on].append(timing)
            print(f"round {r + 1}, mode {'on ' if on else 'off'}: {w.output_tokens / timing.wall:10.1f} output tok/s "
                  f"({timing.wall:.2f} s, {timing.cpu:.2f} CPU s)")
    wall = {on: _median([t.wall for t in ts]) for on, ts in times.items()}
    cpu = {on: _median([t.cpu for t in ts]) for on, ts in times.items()}
    for on in (False, True):
        print(f"batch-invariant {'on ' if on else 'off'} (median): {w.output_tokens / wall[on]:10.1f} output tok/s "
              f"({wall[on]:.2f} s, {cpu[on]:.2f} CPU s)")
    same = sum(a == b for a, b in zip(outputs[False], outputs[True], strict=True))
    print(f"requests with identical tokens in both modes: {same}/{len(w.prompts)}")
    print(f"ratio (on / off time): wall {wall[True] / wall[False]:.3f}, CPU {cpu[True] / cpu[False]:.3f}")
    if getattr(args, "with_transformers", False):
        dtype_name = off.settings.dtype
        assert dtype_name is not None  # resolved when the LLM was built
        hf_batch_size = int(_arg(args, "hf_batch_size"))
        hf, hf_out, attn = run_transformers(str(off.model_dir), torch_dtype(dtype_name), off.device, w, hf_batch_size,
                                            warmup)  # fmt: skip
        print(f"transformers generate:      {w.output_tokens / hf.wall:10.1f} output tok/s ({hf.wall:.2f} s, "
              f"{hf.cpu:.2f} CPU s, static left-padded batches of {hf_batch_size}, {attn} attention)")
        same = sum(a == b for a, b in zip(outputs[True], hf_out, strict=True))
        print(f"requests with identical tokens, mode on and transformers: {same}/{len(w.prompts)}")
        print(f"ratio (mode-on engine / transformers): {hf.wall / wall[True]:.2f}x by wall time, "
              f"{hf.cpu / cpu[True]:.2f}x by CPU seconds")
    return 0


def main(args: argparse.Namespace) -> int:
    """The command: the workload's flags in ``args``, and the engine's (EngineArgs.add_cli_args)."""
    return run(args, EngineArgs.from_cli_args(args))


def run(args: argparse.Namespace, engine: EngineArgs) -> int:
    """The benchmark of ``engine`` on the workload ``args`` describe (``DEFAULTS`` for what it lacks)."""
    check_arguments(args)
    threads = int(_arg(args, "threads") or torch.get_num_threads())
    torch.set_num_threads(threads)  # both sides run under this one setting
    size = engine.tensor_parallel_size
    if size > 1 and getattr(args, "trace", False):
        raise ValueError("--trace and --tensor-parallel-size each replace the transformers side: give one at a time")
    if getattr(args, "with_transformers", False) and not getattr(args, "compare_batch_invariant", False):
        raise ValueError("--with-transformers goes with --compare-batch-invariant (transformers is otherwise the "
                         "other side already)")
    if getattr(args, "compare_batch_invariant", False):
        if size > 1 or getattr(args, "trace", False):
            raise ValueError("--compare-batch-invariant replaces the transformers side: give it without "
                             "--trace or --tensor-parallel-size")
        return compare_batch_invariant(args, engine, threads)
    if size > 1:
        return compare_tensor_parallel(args, engine, threads)
    hf_batch_size = int(_arg(args, "hf_batch_size"))
    llm = LLM(**engine.as_kwargs())
    vocab, seed = llm.limits.vocab_size, engine.seed
    num, max_in, max_out = (_arg(args, k) for k in ("num_requests", "max_input_len", "max_output_len"))
    _check_lengths(llm, max_in, max_out)
    w = make_workload(num, max_in, max_out, vocab, seed)
    if getattr(args, "trace", False):  # TRACE-12: the engine with and without a trace, instead of transformers
        from optimized.trace.cost import measure

        print(f"workload: {num} requests, prompts 1..{max_in}, outputs 1..{max_out} tokens, {threads} torch threads")
        measure(llm, [len(p) for p in w.prompts], w.output_lens, seed)
        return 0
    warmup = make_workload(4, max_in, 4, vocab, seed + 1)
    dtype_name = llm.settings.dtype
    assert dtype_name is not None  # resolved when the LLM was built
    dtype, device = torch_dtype(dtype_name), llm.device
    print(
        f"workload: {num} requests, prompts 1..{max_in}, outputs 1..{max_out} tokens ({w.output_tokens} output "
        f"tokens, greedy, eos ignored), model {llm.model_dir}, {dtype_name} on {device}, "
        f"{threads} torch threads for both sides; untimed warm-up of {len(warmup.prompts)} requests on both sides"
    )
    ours, engine_out = run_engine(llm, w, warmup)
    engine_tps = w.output_tokens / ours.wall
    mode = "eager" if llm.enforce_eager else "graph decode"
    print(
        f"nanoverify engine:          {engine_tps:10.1f} output tok/s ({ours.wall:.2f} s, "
        f"{ours.cpu:.2f} CPU s, continuous batching, {mode}, {llm.settings.attention_backend} attention "
        "backend)"
    )
    hf, hf_out, attn = run_transformers(str(llm.model_dir), dtype, device, w, hf_batch_size, warmup)
    hf_tps = w.output_tokens / hf.wall
    print(
        f"transformers generate:      {hf_tps:10.1f} output tok/s ({hf.wall:.2f} s, {hf.cpu:.2f} CPU s, static "
        f"left-padded batches of {hf_batch_size}, {attn} attention)"
    )
    same = sum(a == b for a, b in zip(engine_out, hf_out, strict=True))
    print(f"requests with identical tokens on both sides: {same}/{len(w.prompts)}")
    print(f"ratio (engine / transformers): {engine_tps / hf_tps:.2f}x (by CPU seconds: {hf.cpu / ours.cpu:.2f}x)")
    return 0


__all__ = ["DEFAULTS", "INVARIANT_ROUNDS", "compare_batch_invariant", "main", "make_workload", "run"]
