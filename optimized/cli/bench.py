"""``nanoverify bench``: benchmarks that print both sides and their ratio in one run.

``scheduler`` times the reference and the optimized scheduler on the same
workloads (optimized/benchmarks/scheduler.py); ``throughput`` runs the engine
against transformers (optimized/benchmarks/throughput.py); ``threads`` runs the
engine under each CPU setting, idle and beside a busy core
(optimized/benchmarks/busy_core.py); ``policies`` replays a trace through every scheduling policy
(optimized/benchmarks/policies.py). The engine's benchmarks import torch, so
they are loaded only when asked for.
"""

from __future__ import annotations

import argparse

from optimized.engine.arg_types import MAX_THREADS, bounded_int
from optimized.engine.args import EngineArgs

HELP = ("benchmarks: 'scheduler' (reference vs optimized scheduler), 'throughput' (the engine vs transformers), "
        "'threads' (CPU settings, idle and with a busy core), 'serve' (the HTTP server vs LLM.generate), "
        "'check' (the engine unchecked vs in check mode), 'determinism' (requests alone and in a crowd), "
        "'policies' (every scheduling policy on a trace)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True)
    sched = sub.add_parser("scheduler", help="schedule()+postprocess() time of both schedulers, side by side")
    from optimized.benchmarks import scheduler

    scheduler.add_arguments(sched)
    tp = sub.add_parser("throughput", help="tokens per second of the engine on a random workload")
    # Defaults (None) come from optimized.benchmarks.throughput.DEFAULTS: one source for the workload (that module
    # imports torch, so it is not imported here).
    tp.add_argument("--num-requests", type=bounded_int(1), default=None)
    tp.add_argument("--max-input-len", type=bounded_int(1), default=None)
    tp.add_argument("--max-output-len", type=bounded_int(1), default=None)
    tp.add_argument("--threads", type=bounded_int(1, MAX_THREADS), default=None,
                    help="torch CPU threads, the same for both sides (default: torch's)")
    tp.add_argument("--hf-batch-size", type=bounded_int(1), default=None,
                    help="batch size of the transformers baseline")
    # The engine's flags; --seed seeds the workload too, --tensor-parallel-size N > 1 runs the engine at TP=1 and
    # TP=N side by side instead of transformers, and --trace (this command's own) the engine with and without one.
    EngineArgs.add_cli_args(tp, exclude=("trace", "trace_wall_times"))
    tp.add_argument("--trace", action="store_true", help="instead of transformers: the engine with and without "
                    "a trace (spec/trace.md), alternating, and the cost")
    tp.add_argument("--compare-batch-invariant", action="store_true", help="instead of transformers: the engine "
                    "with the batch-invariant mode off and on (spec/batch-invariance.md), alternating, and the ratio")
    tp.add_argument("--with-transformers", action="store_true", help="with --compare-batch-invariant: transformers' "
                    "generate too, once, in the same run, and the engine with the mode on against it")
    threads = sub.add_parser("threads", help="the engine under each thread count and OpenMP wait policy, "
                             "idle and with another process spinning on one core")
    from optimized.benchmarks import busy_core

    busy_core.add_arguments(threads)
    serve = sub.add_parser("serve", help="the HTTP server under load (TTFT, TPOT, ITL, throughput), and "
                           "LLM.generate on the same requests with --rate inf")
    from optimized.benchmarks import serve as serve_bench

    serve_bench.add_arguments(serve)
    check = sub.add_parser("check", help="check mode's cost: the engine unchecked and checked on the bench and "
                           "run workloads, alternating, and the ratio (spec/check.md)")
    from optimized.benchmarks import check as check_bench

    check_bench.add_arguments(check)
    determinism = sub.add_parser("determinism", help="requests alone and in a crowd (chunked, preempted, hot "
                                 "prefix cache), batch-invariant mode off and on: tokens and logprob bits")
    from optimized.benchmarks import determinism as determinism_bench

    determinism_bench.add_arguments(determinism)
    policies = sub.add_parser("policies", help="a trace (or a shared-prefix workload) replayed through every "
                              "scheduling policy on the engine: TTFT, TBT, E2E, goodput, hit rate, and each policy "
                              "against the lesson's")
    from optimized.benchmarks import policies as policies_bench

    policies_bench.add_arguments(policies)


def main(args: argparse.Namespace) -> int:
    if args.bench == "scheduler":
        from optimized.benchmarks import scheduler

        return scheduler.main(args)
    if args.bench == "serve":
        from optimized.benchmarks import serve as serve_bench

        return serve_bench.main(args)
    if args.bench == "check":
        from optimized.benchmarks import check as check_bench
        from optimized.cli import run

        return check_bench.main(args, run.workload, run.ENGINE_DEFAULTS)
    if args.bench == "determinism":
        from optimized.benchmarks import determinism as determinism_bench

        return determinism_bench.main(args)
    if args.bench == "policies":
        from optimized.benchmarks import policies as policies_bench

        return policies_bench.main(args)
    if args.bench == "threads":
        from optimized.benchmarks import busy_core

        return busy_core.main(args)
    from optimized.benchmarks import throughput

    code: int = throughput.main(args)
    return code
