"""``nanoverify run``: the main job: a few hundred bench-shaped requests on the default model, in check mode.

Every step the reference scheduler shadows the engine's (optimized/verify/shadow.py);
the command reports throughput, steps, preemptions, prefix-cache hit tokens
and how many steps' decisions were identical to the reference's. The workload
is the benchmark's shape scaled to a CPU: random prompts, half of them opening
with one of a few shared prefixes (so the prefix cache is exercised), random
output lengths, mixed greedy and seeded sampling, and a KV cache small enough
that preemption happens.
"""

from __future__ import annotations

import argparse
import random

from optimized.engine.arg_types import bounded_int
from optimized.engine.args import EngineArgs

HELP = "serve a few hundred requests on the default model in check mode and report"
# The engine settings run has its own defaults for: check mode on, and a KV cache small enough that requests are
# preempted. --seed seeds the workload too.
ENGINE_DEFAULTS = {"check": True, "num_kvcache_blocks": 320, "max_num_seqs": 128}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=bounded_int(1), default=256, metavar="N",
                   help="requests (default: %(default)s)")
    p.add_argument("--max-input-len", type=bounded_int(2), default=128, metavar="N",
                   help="prompt tokens, at most (default: %(default)s)")
    p.add_argument("--max-output-len", type=bounded_int(1), default=96, metavar="N",
                   help="output tokens, at most (default: %(default)s)")
    EngineArgs.add_cli_args(p, ENGINE_DEFAULTS)


def workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(vocab) for _ in range(args.max_input_len // 2)] for _ in range(4)]
    prompts = []
    for i in range(args.num_requests):
        own = [rng.randrange(vocab) for _ in range(rng.randint(1, args.max_input_len // 2))]
        prompts.append(prefixes[i % 4] + own if i % 2 == 0 else own + own[: rng.randint(0, len(own))])
    return prompts, [rng.randint(1, args.max_output_len) for _ in prompts]


def main(args: argparse.Namespace) -> int:
    """Serve the workload and print the report; a ValueError (bad input) is one line from optimized/cli/command.py."""
    import time

    engine = EngineArgs.from_cli_args(args)
    from optimized import LLM, SamplingParams

    llm = LLM(**engine.as_kwargs())
    longest = llm.limits.max_model_len
    if args.max_input_len + args.max_output_len > longest:
        llm.close()
        raise ValueError(f"--max-input-len {args.max_input_len} + --max-output-len {args.max_output_len} exceeds "
                         f"max_model_len={longest}")
    prompts, lens = workload(args, llm.limits.vocab_size)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        if i % 3 == 0
        else SamplingParams(temperature=0.8, top_p=0.95, max_tokens=n, seed=i if i % 3 == 1 else None)
        for i, n in enumerate(lens)
    ]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - start
    st = llm.stats
    generated = sum(len(o.token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p in prompts)
    print(f"model: {llm.model_dir}")
    policy = llm.settings.scheduling_policy
    print(f"scheduling policy: {policy}" + (f" (patience {llm.settings.lpm_patience})" if policy == "lpm" else ""))
    print(f"requests: {len(outs)} ({prompt_tokens} prompt tokens, {generated} generated) in {seconds:.1f} s")
    print(
        f"throughput: {generated / seconds:.1f} output tok/s, {(prompt_tokens + generated) / seconds:.1f} total tok/s"
    )
    mixed = f", {st.mixed_steps} of them mixed with decodes" if st.mixed_steps else ""
    print(f"steps: {st.steps} ({st.prefill_steps} prefill{mixed}, {st.decode_steps} decode)")
    print(f"preemptions: {st.preemptions}")
    print(f"prefix-cache hit tokens: {st.prefix_cache_hit_tokens}")
    print(
        f"finish reasons: stop {sum(o.finish_reason == 'stop' for o in outs)}, "
        f"length {sum(o.finish_reason == 'length' for o in outs)}"
    )
    if not llm.checked:
        print("decisions identical to the reference: not checked (--no-check)")
    else:
        print(f"decisions identical to the reference: {st.compared_steps}/{st.steps} steps")
    if args.trace is not None:
        print(f"trace: {args.trace} (judge it anywhere: nanoverify replay --impl reference {args.trace})")
    llm.close()
    return 0
