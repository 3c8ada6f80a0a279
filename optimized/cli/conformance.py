"""``nanoverify conformance``: replay the shipped samples of every policy with the invariants checked, and summarise.

The lesson's 80 samples (data/conformance.jsonl, CONF-7) come first, then the policies' (data/policies.jsonl,
POLICY-14), one line per implementation and policy: each sample's trace must be the one its policy's
reference recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from importlib import resources
from typing import Any

from invariants import SchedulerState, SeqView, Violation, check_batch, check_state, seq_view, snapshot
from invariants.policy_checks import check_policy
from optimized.core.config import POLICIES
from optimized.verify.conformance import implementation, parse_workload, replay
from optimized.verify.reference_port import ReferencePort
from reference.lpm_scheduler import LpmScheduler
from reference.priority_scheduler import PriorityScheduler

HELP = "replay the shipped conformance samples of every policy with invariant checks on and print a summary"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--impl", choices=("reference", "optimized", "both"), default="both")


def _read(name: str) -> list[dict[str, Any]]:
    text = resources.files("optimized.verify").joinpath(f"data/{name}").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def shipped_samples() -> list[dict[str, Any]]:
    """The lesson's 80 samples (CONF-7)."""
    return _read("conformance.jsonl")


def shipped_policy_samples() -> list[dict[str, Any]]:
    """The other policies' samples, each traced by its policy's reference (POLICY-14)."""
    return _read("policies.jsonl")


def policy_of(sample: dict[str, Any]) -> str:
    policy: str = sample["workload"]["config"].get("policy", "lesson")
    return policy


def policy_snapshot(scheduler: Any) -> SchedulerState:
    """``snapshot(scheduler)`` with its policy's fields (``policy``, ``priorities`` of the live sequences,
    ``passes`` of the waiting ones, ``patience``). The optimized classes fill them; for the reference's adapter
    they are read off the policy's reference here when its snapshot leaves them out."""
    state = snapshot(scheduler)
    if not isinstance(scheduler, ReferencePort) or state.policy == scheduler.config.policy:
        return state
    lesson = scheduler.lesson_scheduler
    state = dataclasses.replace(state, policy=scheduler.config.policy)
    if isinstance(lesson, PriorityScheduler):
        state.priorities = {s.seq_id: lesson.priority[s.seq_id] for s in (*lesson.waiting, *lesson.running)}
    if isinstance(lesson, LpmScheduler):
        state.passes = {s.seq_id: lesson.passes[s.seq_id] for s in lesson.waiting}
        state.patience = lesson.patience
    return state


def step_violations(state: SchedulerState, batch: list[SeqView], is_prefill: bool) -> list[Violation]:
    """Right after schedule(): the policy's own clauses (POLICY-2, 6, 10: they read no block) and every batch clause,
    as ``check_batch`` reads them for the state's policy (a ``mixed`` step by the mixed clauses). Every state
    clause is checked between steps."""
    return check_policy(state) + check_batch(state, batch, is_prefill)


def _replay_checked(sample: dict[str, Any], impl_name: str) -> tuple[bool, int, list[Violation]]:
    impl = implementation(impl_name)
    violations: list[Violation] = []

    def after_schedule(scheduler: Any, seqs: list[Any], is_prefill: bool) -> None:
        violations.extend(step_violations(policy_snapshot(scheduler), [seq_view(s) for s in seqs], is_prefill))

    def after_postprocess(scheduler: Any, seqs: list[Any], is_prefill: bool) -> None:
        violations.extend(check_state(policy_snapshot(scheduler)))

    trace = replay(parse_workload(sample["workload"]), impl, after_schedule, after_postprocess)
    return trace == sample["trace"], len(trace), violations


def main(args: argparse.Namespace) -> int:
    lesson, others = shipped_samples(), shipped_policy_samples()
    groups = [("lesson", lesson)] + [(p, [s for s in others if policy_of(s) == p]) for p in POLICIES if p != "lesson"]
    names = ["reference", "optimized"] if args.impl == "both" else [args.impl]
    failed = False
    for name in names:
        for policy, samples in groups:
            start = time.perf_counter()
            identical = steps = 0
            violations: list[Violation] = []
            for sample in samples:
                same, n, found = _replay_checked(sample, name)
                identical += same
                steps += n
                violations.extend(found)
            seconds = time.perf_counter() - start
            whose = "the lesson's" if policy == "lesson" else f"the {policy} reference's"
            print(f"{name:>9}: {identical}/{len(samples)} traces identical to {whose}, "
                  f"{steps} steps, {len(violations)} invariant violations, {seconds:.2f}s")
            for v in violations[:10]:
                print(f"           {v.clause}: {v.message}")
            failed |= identical != len(samples) or bool(violations) or not samples
    return 1 if failed else 0
