"""``nanoverify gpu-check``: the device check (spec/gpu.md) — kernels, graphs, throughput and the decode floor.

On a CUDA machine it runs the full profile (a Qwen3-0.6B-shaped random checkpoint, nano-vllm's bench workload);
``--device cpu --tiny`` runs the same stages with tiny shapes on the CPU, which is how CI proves the pipeline.
The table is printed last, on standard output; progress goes to standard error. Exit 0 when every row passes,
1 when one does not, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from optimized.engine.arg_types import positive_seconds, work_folder

HELP = "check the engine on a GPU: kernel tests, eager vs CUDA graphs, throughput vs transformers, decode floor"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and workload (the CPU dry run)")
    p.add_argument("--work", type=work_folder, default=None,
                   help="folder for checkpoints, logs and results (default: a temporary folder, removed afterwards)")
    p.add_argument("--keep", action="store_true", help="keep the temporary work folder")
    p.add_argument("--stages", default=None, help="comma-separated subset of the stages, in their usual order")
    p.add_argument("--deadline-s", type=positive_seconds, default=None,
                   help="override the profile's whole-run deadline (seconds, finite, > 0)")


def main(args: argparse.Namespace) -> int:
    import torch

    from optimized.benchmarks.gpu_check import check
    from optimized.benchmarks.gpu_profile import STAGES, profile_for

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("nanoverify gpu-check: device: 'cuda' requested but CUDA is not available", file=sys.stderr)
        return 2
    try:
        profile = profile_for(args.tiny, device)
    except ValueError as e:
        print(f"nanoverify gpu-check: {e}", file=sys.stderr)
        return 2
    stages: tuple[str, ...] = STAGES
    if args.stages is not None:
        wanted = [s.strip() for s in args.stages.split(",") if s.strip()]
        unknown = [s for s in wanted if s not in STAGES]
        if unknown or not wanted:
            print(f"nanoverify gpu-check: stages: unknown {unknown}; choose from {', '.join(STAGES)}", file=sys.stderr)
            return 2
        stages = tuple(s for s in STAGES if s in wanted)
    if args.deadline_s is not None:
        profile = replace(profile, deadline_s=float(args.deadline_s))
    code, table = check(profile, args.work, args.keep, stages)
    print(table, flush=True)
    return code
