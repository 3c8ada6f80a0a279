"""``nanoverify generate``: complete a few prompts with the engine and print the completions.

Prompts must be UTF-8 text: an argument holding other bytes is refused (CLI-5). The
sampling flags are checked by ``SamplingParams``, built before the model loads, so a
bad one costs no load. The engine flags are ``EngineArgs``' but its seed: ``--seed`` is the
requests' own (``SamplingParams.seed``), so every prompt draws with it and the same prompt
twice gives the same text.
"""

from __future__ import annotations

import argparse

from optimized.engine.arg_types import any_int, utf8_text
from optimized.engine.args import EngineArgs

HELP = "generate completions for the given prompts"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="+", metavar="PROMPT", type=utf8_text, help="UTF-8 text")
    p.add_argument("--max-tokens", type=int, default=32, help="default: %(default)s")
    p.add_argument("--temperature", type=float, default=0.0, help="default: %(default)s (greedy)")
    p.add_argument("--top-k", type=int, default=-1, help="default: %(default)s (off)")
    p.add_argument("--top-p", type=float, default=1.0, help="default: %(default)s")
    p.add_argument("--seed", type=any_int, default=None, metavar="N",
                   help="the seed of every prompt's draws (SamplingParams.seed): a prompt given twice gives the same "
                   "text twice (default: none: unseeded draws, seeded by the engine's seed 0)")
    EngineArgs.add_cli_args(p, exclude=("seed",))  # --seed is the requests' (above), not the engine's


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
    llm = LLM(**EngineArgs.from_cli_args(args).as_kwargs())
    outs = llm.generate(list(args.prompts), params, use_tqdm=False)
    for prompt, out in zip(args.prompts, outs, strict=True):
        print(f"--- {prompt!r} -> ({len(out.token_ids)} tokens, {out.finish_reason})")
        print(out.text)
    llm.close()
    return 0
