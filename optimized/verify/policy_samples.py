"""The policies' conformance samples (POLICY-14): workloads drawn from fixed seeds, traced by each policy's reference.

Invariant: ``samples()`` is a pure function of this file: the same seeds draw the same workloads, and each
trace is what ``replay`` records on the reference of the workload's ``config.policy`` (reference/ beside the
lesson's scheduler), so ``optimized/verify/data/policies.jsonl`` is exactly its output, one sample a line
(``python -m optimized.verify.policy_samples > optimized/verify/data/policies.jsonl`` writes it;
tests/test_conformance_policies.py checks it). The draws make what each policy decides differently matter:
shared system prompts (prefix hits, lpm's order), budgets that chunk, caches that preempt, arrivals spread
over steps; ``priority`` requests carry a priority, ``lpm`` workloads a patience (or the default). Every
request fits the cache alone (ADMIT-1), so no trace ends in the empty decode.
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

from optimized.verify.conformance import implementation, parse_workload, replay

POLICIES = ("mixed", "priority", "lpm")  # the lesson's own samples are conformance.jsonl
PER_POLICY = 15


def draw_workload(policy: str, rng: random.Random) -> dict[str, Any]:
    """One workload of ``policy`` (CONF-1's format, with ``config.policy`` and the policy's own fields)."""
    block_size = rng.choice((2, 2, 4, 4, 8))
    eos = rng.randrange(4)
    prompts = [[rng.randrange(1, 9) for _ in range(block_size * rng.randint(1, 3))] for _ in range(rng.randint(1, 3))]
    count = rng.randint(4, 12)
    requests: list[dict[str, Any]] = []
    longest = 0
    for i in range(count):
        shared = rng.choice(prompts) if rng.random() < 0.7 else []
        prompt = shared + [rng.randrange(1, 9) for _ in range(rng.randint(1, 3 * block_size))]
        max_tokens = rng.randint(1, 12)
        longest = max(longest, len(prompt) + max_tokens - 1)
        request: dict[str, Any] = {
            "id": i, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": rng.random() < 0.5,
            "arrive": rng.choice((0, 0, rng.randint(0, 12))),
            "output": [rng.randrange(0, 9) for _ in range(max_tokens)]}
        if policy == "priority":
            request["priority"] = rng.randint(-2, 3)
        requests.append(request)
    fit = -(-longest // block_size)  # the largest request's blocks: every request fits alone (ADMIT-1)
    config: dict[str, Any] = {
        "block_size": block_size,
        "num_blocks": fit + rng.choice((0, 1, 2, fit, 4 * fit)),  # from preempting at once to roomy
        "max_num_seqs": rng.choice((1, 2, 3, 4, 8)),
        "max_num_batched_tokens": rng.choice((block_size, 2 * block_size + 1, 16, 64, 4096)),
        "eos": eos, "policy": policy}
    if policy == "lpm" and rng.random() < 0.8:
        config["patience"] = rng.randint(0, 4)
    return {"config": config, "requests": requests}


def samples(policies: tuple[str, ...] = POLICIES, per_policy: int = PER_POLICY) -> list[dict[str, Any]]:
    """``per_policy`` samples of each policy: a drawn workload and its reference trace."""
    out: list[dict[str, Any]] = []
    for policy in policies:
        for i in range(per_policy):
            workload = draw_workload(policy, random.Random(f"{policy}-{i}"))
            trace = replay(parse_workload(workload), implementation("reference"))
            out.append({"workload": workload, "trace": trace})
    return out


def main() -> int:
    for sample in samples():
        sys.stdout.write(json.dumps(sample, separators=(", ", ": ")) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
