"""``nanoverify conformance``: replay the shipped samples with every invariant checked, and summarise."""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources
from typing import Any

from invariants import Violation, check_batch, check_state, seq_view, snapshot
from optimized.verify.conformance import implementation, parse_workload, replay

HELP = "replay the shipped conformance samples with invariant checks on and print a summary"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--impl", choices=("reference", "optimized", "both"), default="both")


def shipped_samples() -> list[dict[str, Any]]:
    text = resources.files("optimized.verify").joinpath("data/conformance.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _replay_checked(sample: dict[str, Any], impl_name: str) -> tuple[bool, int, list[Violation]]:
    impl = implementation(impl_name)
    violations: list[Violation] = []

    def after_schedule(scheduler: Any, seqs: list[Any], is_prefill: bool) -> None:
        violations.extend(check_batch(snapshot(scheduler), [seq_view(s) for s in seqs], is_prefill))

    def after_postprocess(scheduler: Any, seqs: list[Any], is_prefill: bool) -> None:
        violations.extend(check_state(snapshot(scheduler)))

    trace = replay(parse_workload(sample["workload"]), impl, after_schedule, after_postprocess)
    return trace == sample["trace"], len(trace), violations


def main(args: argparse.Namespace) -> int:
    samples = shipped_samples()
    names = ["reference", "optimized"] if args.impl == "both" else [args.impl]
    failed = False
    for name in names:
        start = time.perf_counter()
        identical = steps = 0
        violations: list[Violation] = []
        for sample in samples:
            same, n, found = _replay_checked(sample, name)
            identical += same
            steps += n
            violations.extend(found)
        seconds = time.perf_counter() - start
        print(f"{name:>9}: {identical}/{len(samples)} traces identical to the lesson's, "
              f"{steps} steps, {len(violations)} invariant violations, {seconds:.2f}s")
        for v in violations[:10]:
            print(f"           {v.clause}: {v.message}")
        failed |= identical != len(samples) or bool(violations)
    return 1 if failed else 0
