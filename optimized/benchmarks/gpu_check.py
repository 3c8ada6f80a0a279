"""The ``nanoverify gpu-check`` orchestrator: every stage in its own process, under its budget, then one table.

Invariants: stages run in the order of ``gpu_profile.STAGES``, one at a time (they share the device), each in a
fresh process group killed when its budget, or what is left of the run's deadline, runs out; a stage that times
out, crashes or writes no result gets a TIMEOUT or ERROR row and the next stage runs — nothing a stage does ends
the check. Stages that need the bench checkpoint are SKIPped when the checkpoint stage did not pass. The table
is printed last, one row per stage plus a row of throughput ratios, and the exit status is 0 only when every row
is PASS (GPU-1 in spec/gpu.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from optimized.benchmarks.gpu_profile import STAGES, Profile

NEEDS_CHECKPOINT = frozenset({"engine-graphs", "engine-eager", "transformers", "decode-floor"})
CLAUSES = {
    "kernels": "GPU-2",
    "kernels-direct": "GPU-3",
    "kernels-invariant": "GPU-4",
    "graphs-exact": "GPU-5",
    "checkpoint": "GPU-6",
    "engine-graphs": "GPU-7",
    "engine-eager": "GPU-7",
    "transformers": "GPU-7",
    "throughput": "GPU-7",
    "decode-floor": "GPU-8",
}
MIN_STAGE_S = 5.0  # a stage is not started with less than this left of the deadline


@dataclass
class Row:
    stage: str
    status: str  # PASS, FAIL, TIMEOUT, ERROR, SKIP
    seconds: float
    summary: str
    metrics: dict[str, Any]


def stage_env(profile: Profile, stage: str) -> dict[str, str]:
    env = dict(os.environ)
    # Triton decides interpreted-vs-compiled at import: only the CPU kernel checks run interpreted.
    if stage == "kernels-direct" and profile.device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def run_stage(profile: Profile, stage: str, work: Path, budget: float) -> Row:
    out = work / f"{stage}.json"
    cmd = [sys.executable, "-m", "optimized.benchmarks.gpu_stages", stage, "--profile", profile.name,
           "--device", profile.device, "--work", str(work), "--out", str(out)]
    start = time.perf_counter()
    with open(work / f"{stage}.log", "w") as stage_log:
        proc = subprocess.Popen(cmd, stdout=stage_log, stderr=subprocess.STDOUT, env=stage_env(profile, stage),
                                start_new_session=True)
        try:
            proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the stage's own children (pytest) too
            proc.wait()
            return Row(stage, "TIMEOUT", time.perf_counter() - start, f"killed after its budget of {budget:.0f} s",
                       {})
    seconds = time.perf_counter() - start
    if not out.is_file():
        tail = (work / f"{stage}.log").read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return Row(stage, "ERROR", seconds, f"exit {proc.returncode}: {tail[0][:200]}", {})
    data = json.loads(out.read_text())
    return Row(stage, str(data["status"]), seconds, str(data["summary"]), dict(data["metrics"]))


def throughput_row(rows: dict[str, Row]) -> Row:
    parts, metrics = [], {}
    rates = {name: rows[name].metrics.get("tokens_per_s") for name in ("engine-graphs", "engine-eager",
                                                                        "transformers") if name in rows}
    g, e, t = rates.get("engine-graphs"), rates.get("engine-eager"), rates.get("transformers")
    if g and e:
        metrics["graphs_over_eager"] = g / e
        parts.append(f"graphs/eager {g / e:.2f}x")
    if g and t:
        metrics["engine_over_transformers"] = g / t
        parts.append(f"engine(graphs)/transformers {g / t:.2f}x (per output token)")
    inputs_passed = all(rows[name].status == "PASS" for name in ("engine-graphs", "engine-eager", "transformers"))
    summary = ", ".join(parts) or "needs both engine runs and transformers"
    if not inputs_passed:
        summary += " (not every input row passed)"
    return Row("throughput", "PASS" if len(parts) == 2 and inputs_passed else "SKIP", 0.0, summary, metrics)


def run_all(profile: Profile, work: Path, log: TextIO, stages: tuple[str, ...] = STAGES) -> list[Row]:
    deadline = time.monotonic() + profile.deadline_s
    rows: dict[str, Row] = {}
    for stage in stages:
        left = deadline - time.monotonic()
        if stage in NEEDS_CHECKPOINT and rows.get("checkpoint", Row("", "SKIP", 0, "", {})).status != "PASS":
            rows[stage] = Row(stage, "SKIP", 0.0, "no bench checkpoint (the checkpoint stage did not pass)", {})
        elif left < MIN_STAGE_S:
            rows[stage] = Row(stage, "SKIP", 0.0, f"the run's deadline of {profile.deadline_s:.0f} s was reached", {})
        else:
            print(f"[gpu-check] {stage} (budget {min(profile.budgets[stage], left):.0f} s) ...", file=log, flush=True)
            rows[stage] = run_stage(profile, stage, work, min(profile.budgets[stage], left))
            r = rows[stage]
            print(f"[gpu-check] {stage}: {r.status} in {r.seconds:.1f} s: {r.summary}", file=log, flush=True)
    ordered = [rows[s] for s in stages]
    if {"engine-graphs", "engine-eager", "transformers"} <= set(rows):
        ordered.append(throughput_row(rows))
    return ordered


def format_table(rows: list[Row], header: str) -> str:
    width = max(len(r.stage) for r in rows)
    lines = [header, f"{'stage':<{width}}  {'status':<7} {'secs':>6}  {'spec':<6} result"]
    for r in rows:
        lines.append(f"{r.stage:<{width}}  {r.status:<7} {r.seconds:6.1f}  {CLAUSES.get(r.stage, ''):<6} {r.summary}")
    passed = sum(r.status == "PASS" for r in rows)
    lines.append(f"gpu-check: {passed}/{len(rows)} rows PASS")
    return "\n".join(lines)


def describe(profile: Profile) -> str:
    import torch

    where = torch.cuda.get_device_name() if profile.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    return (f"nanoverify gpu-check: profile {profile.name} on {profile.device} ({where}), torch {torch.__version__}, "
            f"{time.strftime('%Y-%m-%d %H:%M')}")


def check(profile: Profile, work: Path | None, keep: bool, stages: tuple[str, ...] = STAGES) -> tuple[int, str]:
    """Run the stages; (exit status, the table). The work folder is removed afterwards unless ``keep``."""
    own = work is None
    folder = Path(tempfile.mkdtemp(prefix="nanoverify-gpu-check-")) if work is None else work
    folder.mkdir(parents=True, exist_ok=True)
    try:
        rows = run_all(profile, folder, sys.stderr, stages)
    finally:
        if own and not keep:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)
    table = format_table(rows, describe(profile) + (f"; logs in {folder}" if keep or not own else ""))
    return (0 if all(r.status == "PASS" for r in rows) else 1), table
