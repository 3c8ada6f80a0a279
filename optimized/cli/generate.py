"""``nanoverify generate``: complete a few prompts with the engine and print the completions.

Prompts must be UTF-8 text: an argument holding other bytes is refused (CLI-5). The
sampling flags are checked by ``SamplingParams``, built before the model loads, so a
bad one costs no load.
"""

from __future__ import annotations

import argparse

from optimized.cli.arguments import any_int, bounded_int, checkpoint_folder, utf8_text
from optimized.trace.options import add_trace_arguments, trace_options

HELP = "generate completions for the given prompts"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="+", metavar="PROMPT", type=utf8_text, help="UTF-8 text")
    p.add_argument("--model", type=checkpoint_folder, default=None,
                   help="checkpoint folder (default: the embedded default model)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=any_int, default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--device", default=None)
    p.add_argument("--tensor-parallel-size", type=bounded_int(1), default=1,
                   help="split the model over this many processes (under torchrun: its WORLD_SIZE)")
    p.add_argument("--check", action="store_true", help="shadow the scheduler with the reference")
    add_trace_arguments(p)


def main(args: argparse.Namespace) -> int:
    from optimized import LLM, SamplingParams

    # ValueError (a bad flag, a bad checkpoint) is reported by optimized/cli/command.py as one line, exit 2.
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    llm = LLM(args.model, dtype=args.dtype, device=args.device, check=args.check, num_kvcache_blocks=None,
              tensor_parallel_size=args.tensor_parallel_size, **trace_options(args))
    outs = llm.generate(list(args.prompts), params, use_tqdm=False)
    for prompt, out in zip(args.prompts, outs, strict=True):
        print(f"--- {prompt!r} -> ({len(out.token_ids)} tokens, {out.finish_reason})")
        print(out.text)
    llm.close()
    return 0
