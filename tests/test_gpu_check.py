"""``nanoverify gpu-check``: the whole pipeline on the CPU with tiny shapes, the floor's arithmetic, and the
orchestrator's handling of a stage that crashes, overruns or is starved by the deadline.

The end-to-end test runs ``nanoverify gpu-check --device cpu --tiny`` once (module fixture, well under a minute)
and checks the printed table and the stages' recorded metrics; the other tests are in-process and quick.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from optimized.benchmarks import gpu_check, gpu_stages
from optimized.benchmarks.decode_floor import decode_floor, kv_bytes_per_token, weight_bytes
from optimized.benchmarks.gpu_profile import GPU, QWEN3_0_6B, STAGES, TINY, profile_for
from optimized.benchmarks.random_checkpoint import num_parameters, write_random_checkpoint
from optimized.models.loader import load_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    work = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-m", "optimized.cli", "gpu-check", "--device", "cpu", "--tiny", "--work", str(work)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    return proc, work


def _rows(stdout: str) -> dict[str, list[str]]:
    """stage -> [status, seconds, clause, result] from the table (the last lines of standard output)."""
    lines = stdout.strip().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("stage "))
    rows = {}
    for line in lines[start + 1 : -1]:
        stage, status, seconds, rest = line.split(None, 3)
        clause, _, summary = rest.partition(" ")
        rows[stage] = [status, seconds, clause, summary.strip()]
    return rows


def _metrics(work: Path, stage: str) -> dict[str, Any]:
    import json

    data: dict[str, Any] = json.loads((work / f"{stage}.json").read_text())
    return dict(data["metrics"])


@pytest.mark.clause("GPU-1", "GPU-9")
def test_tiny_run_prints_every_stage_passing_with_its_clause(tiny_run: tuple[Any, Path]) -> None:
    """GPU-1, GPU-9: every stage in order, one row each plus the throughput row, each citing its clause; the
    table is the last thing printed and every row passes, so the exit status is 0."""
    proc, _ = tiny_run
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = _rows(proc.stdout)
    assert list(rows) == [*STAGES, "throughput"]
    assert proc.stdout.strip().splitlines()[-1] == f"gpu-check: {len(rows)}/{len(rows)} rows PASS"
    assert "profile tiny on cpu" in proc.stdout
    for stage, (status, seconds, clause, summary) in rows.items():
        assert status == "PASS", (stage, summary)
        assert clause == gpu_check.CLAUSES[stage] and re.fullmatch(r"GPU-[1-9]", clause)
        assert float(seconds) >= 0 and summary


@pytest.mark.clause("GPU-2", "GPU-3")
def test_tiny_run_kernel_rows(tiny_run: tuple[Any, Path]) -> None:
    """GPU-2, GPU-3: the pytest subset ran under the interpreter and is reported as such; every direct kernel
    check equals torch."""
    proc, work = tiny_run
    rows = _rows(proc.stdout)
    kernels = rows["kernels"][3]
    assert re.match(r"[1-9]\d* passed, 0 failed, 0 skipped; Triton interpreted", kernels), kernels
    m = _metrics(work, "kernels")
    assert m["passed"] >= 1 and m["failures"] == m["errors"] == 0 and m["triton_compiled"] is False
    direct = _metrics(work, "kernels-direct")["checks"]
    assert set(direct) == {f"{k}/float32" for k in ("store_kv", "prefill", "decode", "add_rms_norm", "rotary",
                                                     "sampling")}
    assert set(direct.values()) == {"pass"}
    assert rows["kernels-direct"][3].startswith("6/6 kernel checks equal torch")


@pytest.mark.clause("GPU-4")
def test_tiny_run_kernels_invariant_row(tiny_run: tuple[Any, Path]) -> None:
    """GPU-4: the batch-invariance tests of the Triton kernels ran in their own row, interpreted on the CPU, and
    every one selected passed; the GPU profile runs the whole file there and keeps it out of the kernels row."""
    proc, work = tiny_run
    summary = _rows(proc.stdout)["kernels-invariant"][3]
    assert re.match(r"[1-9]\d* passed, 0 failed, 0 skipped; Triton interpreted", summary), summary
    assert "Triton batch invariance, KERN-28/29 (-k float32_bound or refuses)" in summary
    m = _metrics(work, "kernels-invariant")
    assert m["passed"] >= 1 and m["failures"] == m["errors"] == 0 and m["triton_compiled"] is False
    assert TINY.invariant_pytest_args[0] == GPU.invariant_pytest_args[0] == "tests/kernels/test_triton_invariance.py"
    assert GPU.invariant_pytest_args == (GPU.invariant_pytest_args[0],)  # the whole file on the device
    assert f"--ignore={GPU.invariant_pytest_args[0]}" in GPU.kernel_pytest_args


@pytest.mark.clause("GPU-5")
def test_tiny_run_graphs_are_token_exact_and_used(tiny_run: tuple[Any, Path]) -> None:
    """GPU-5: eager and graph decode agree on every token, and the graph LLM really decoded through graphs."""
    proc, work = tiny_run
    m = _metrics(work, "graphs-exact")
    assert m["differing"] == 0 and m["graph_buckets"] >= 1
    assert m["tokens"] == sum(TINY.exact_batches) * TINY.exact_max_tokens
    assert "0 requests differ" in _rows(proc.stdout)["graphs-exact"][3]


@pytest.mark.clause("GPU-6", "GPU-7")
def test_tiny_run_checkpoint_and_throughput_numbers(tiny_run: tuple[Any, Path]) -> None:
    """GPU-6, GPU-7: the checkpoint loads with every parameter; both engine modes produce exactly the requested
    tokens at a finite positive rate; transformers' subset is stated; the ratios row is their quotient."""
    proc, work = tiny_run
    assert _metrics(work, "checkpoint")["parameters"] == num_parameters(TINY.bench_model)
    outs = gpu_stages.bench_requests(TINY.workload, TINY.bench_model.vocab)[1]
    rates = {}
    for stage in ("engine-graphs", "engine-eager", "transformers"):
        m = _metrics(work, stage)
        assert math.isfinite(m["tokens_per_s"]) and m["tokens_per_s"] > 0 and m["seconds"] > 0
        rates[stage] = m["tokens_per_s"]
    assert _metrics(work, "engine-graphs")["output_tokens"] == sum(outs)
    assert _metrics(work, "engine-graphs")["graphs"] is True
    assert _metrics(work, "transformers")["output_tokens"] == sum(outs[: TINY.hf_requests])
    rows = _rows(proc.stdout)
    assert f"first {TINY.hf_requests}/{TINY.workload.num_requests} requests" in rows["transformers"][3]
    ratio = re.search(r"graphs/eager (\d+\.\d+)x", rows["throughput"][3])
    assert ratio and float(ratio.group(1)) == pytest.approx(rates["engine-graphs"] / rates["engine-eager"], abs=0.01)


@pytest.mark.clause("GPU-8")
def test_tiny_run_decode_floor(tiny_run: tuple[Any, Path]) -> None:
    """GPU-8: a measured CPU copy bandwidth, the floor's bytes from the model and the batch's contexts, and each
    mode's median step no faster than its floor."""
    _, work = tiny_run
    m = _metrics(work, "decode-floor")
    assert m["batch"] == TINY.floor_batch and 1e8 < m["bandwidth"] < 1e13
    for mode in ("graphs", "eager"):
        r = m[mode]
        assert 0 < r["floor_s"] <= r["step_s"] and r["efficiency"] == pytest.approx(r["floor_s"] / r["step_s"])
        assert r["kv_read_bytes"] > 0 and r["weight_bytes"] > 0


@pytest.mark.clause("GPU-8")
def test_floor_bytes_follow_the_formula(tmp_path: Path) -> None:
    """GPU-8: W counts the tied embedding once (as lm_head) plus the gathered rows; untied, the embedding matrix
    is only gathered; KV bytes are 2 * L * kvh * d * e per token read, plus the new tokens written."""
    for tied in (True, False):
        shape = replace(TINY.bench_model, tie_embeddings=tied)
        folder = tmp_path / f"tied-{tied}"
        write_random_checkpoint(folder, shape, torch.float32, torch.device("cpu"), seed=1)
        model = load_model(folder, torch.float32, torch.device("cpu"))
        per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * 4
        assert kv_bytes_per_token(model) == per_token
        embed = shape.vocab * shape.hidden * 4
        expected_w = num_parameters(shape) * 4 - (0 if tied else embed) + 3 * shape.hidden * 4
        assert weight_bytes(model, 3) == expected_w
        f = decode_floor(model, [5, 0, 11], bandwidth=1e9)
        assert (f.kv_read_bytes, f.kv_write_bytes) == (16 * per_token, 3 * per_token)
        assert f.seconds == pytest.approx((expected_w + 19 * per_token) / 1e9)


@pytest.mark.clause("GPU-6", "GPU-7")
def test_the_bench_shapes_are_qwen3_0_6b_and_nano_vllm_bench() -> None:
    """GPU-6, GPU-7: the GPU profile's model and workload are the ones the spec names."""
    assert num_parameters(QWEN3_0_6B) == 596_049_920
    assert GPU.bench_model == QWEN3_0_6B and GPU.bench_dtype == "bfloat16"
    w = GPU.workload
    assert (w.num_requests, w.min_len, w.max_len) == (256, 100, 1024)
    prompts, outs = gpu_stages.bench_requests(w, QWEN3_0_6B.vocab)
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(100 <= n <= 1024 for n in outs)
    assert GPU.floor_batch == 256 and set(GPU.budgets) == set(STAGES) == set(TINY.budgets)
    assert sum(GPU.budgets.values()) > GPU.deadline_s and GPU.deadline_s <= 450  # the deadline binds, not the sum


@pytest.mark.clause("GPU-1")
def test_a_crashing_or_overrunning_stage_is_a_row_not_a_crash(tmp_path: Path) -> None:
    """GPU-1: a stage that raises is an ERROR row naming the exception; one past its budget is killed and is a
    TIMEOUT row; stages after a failed checkpoint are SKIPped, as are stages past the deadline."""
    crashed = gpu_check.run_stage(TINY, "transformers", tmp_path, budget=120)
    assert crashed.status == "ERROR" and "FileNotFoundError" in crashed.summary
    slow = gpu_check.run_stage(TINY, "checkpoint", tmp_path, budget=0.2)
    assert slow.status == "TIMEOUT" and "budget" in slow.summary
    starved = replace(TINY, deadline_s=0.0)
    rows = gpu_check.run_all(starved, tmp_path, sys.stderr, ("checkpoint", "engine-eager"))
    assert [(r.stage, r.status) for r in rows] == [("checkpoint", "SKIP"), ("engine-eager", "SKIP")]
    assert "deadline" in rows[0].summary and "checkpoint" in rows[1].summary
    table = gpu_check.format_table([crashed, slow, *rows], "header")
    assert table.splitlines()[-1] == "gpu-check: 0/4 rows PASS"


@pytest.mark.clause("GPU-9")
def test_bad_arguments_exit_2_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    """GPU-9: the full profile refuses the CPU; unknown stages and a non-positive deadline are refused."""
    from optimized.cli import main

    with pytest.raises(ValueError, match="device"):
        profile_for(False, "cpu")
    assert main(["gpu-check", "--device", "cpu"]) == 2
    assert "device" in capsys.readouterr().err
    assert main(["gpu-check", "--device", "cpu", "--tiny", "--stages", "bogus"]) == 2
    assert "stages" in capsys.readouterr().err
    assert main(["gpu-check", "--device", "cpu", "--tiny", "--deadline-s", "0"]) == 2
    assert "deadline-s" in capsys.readouterr().err


@pytest.mark.clause("GPU-2", "GPU-5")
def test_verdicts_report_an_interpreted_gpu_run_failures_and_differing_tokens() -> None:
    """GPU-2, GPU-5: a GPU kernel run that was interpreted fails even with every test passing; a failed test fails;
    a request whose graph tokens differ is named with its first differing token."""
    clean = {"tests": 5, "failures": 0, "errors": 0, "skipped": 0, "passed": 5}
    assert gpu_stages.kernels_verdict(clean, True, "0", "cuda")[0]
    ok, summary = gpu_stages.kernels_verdict(clean, False, "1", "cuda")
    assert not ok and "not a GPU run" in summary and "TRITON_INTERPRET=1" in summary
    assert gpu_stages.kernels_verdict(clean, False, "1", "cpu")[0]
    assert not gpu_stages.kernels_verdict({**clean, "errors": 1, "passed": 4}, True, "0", "cuda")[0]
    assert not gpu_stages.kernels_verdict({**clean, "skipped": 5, "passed": 0}, True, "0", "cuda")[0]
    assert gpu_stages.token_diffs(3, [[1, 2], [3, 4]], [[1, 2], [3, 4]]) == []
    assert gpu_stages.token_diffs(3, [[1, 2], [3, 4]], [[1, 2], [3, 5]]) == ["B=3 request 1 differs from token 1"]


@pytest.mark.clause("GPU-5")
def test_graph_info_tells_eager_from_graph_decoding(tmp_path: Path) -> None:
    """GPU-5: an eager LLM has no graph runner; with enforce_eager=False graphs are found, and counted once used."""
    from optimized.engine.sampling_params import SamplingParams
    from optimized.entry.llm import LLM

    write_random_checkpoint(tmp_path, TINY.exact_model, torch.float32, torch.device("cpu"), seed=2)
    eager = LLM(str(tmp_path), device="cpu", enforce_eager=True, num_kvcache_blocks=16, max_model_len=64)
    assert gpu_stages.graph_info(eager) == (False, 0)
    graphs = LLM(str(tmp_path), device="cpu", enforce_eager=False, num_kvcache_blocks=16, max_model_len=64)
    assert not gpu_stages.graph_info(graphs)[0]  # nothing decoded through graphs yet
    graphs.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    used, buckets = gpu_stages.graph_info(graphs)
    assert used and buckets >= 1


@pytest.mark.clause("GPU-3")
def test_kernel_checks_report_a_corrupted_oracle(tmp_path: Path) -> None:
    """GPU-3: each direct kernel check fails when its torch oracle is corrupted, and a crash is reported by name
    while the other checks still run (interpreter, in a child process so TRITON_INTERPRET precedes triton)."""
    script = '''
import torch
from kernels import norm, paged_attention, rotary, sampling
from optimized.benchmarks.gpu_profile import TINY
from optimized.benchmarks.kernel_direct import KernelCase, run_checks

store = paged_attention.store_kv
def bad_store(k, v, kc, vc, slots):
    store(k, v, kc, vc, slots)
    kc.view(-1)[0] += 1
def boom(*args):
    raise RuntimeError("boom")
paged_attention.store_kv = bad_store
prefill = paged_attention.paged_prefill
paged_attention.paged_prefill = lambda *a: prefill(*a) + 0.5
paged_attention.paged_decode = boom
add = norm.add_rms_norm
norm.add_rms_norm = lambda *a: (add(*a)[0], add(*a)[1] + 1)
rot = rotary.apply_rotary
rotary.apply_rotary = lambda *a: (rot(*a)[0] * 2, rot(*a)[1])
draw = sampling.sample
sampling.sample = lambda *a: (draw(*a) + 1) % TINY.bench_model.vocab
case = KernelCase(TINY.bench_model, torch.float32, torch.device("cpu"), 4, (1, 7, 0, 20),
                  torch.Generator().manual_seed(5))
print(run_checks(case))
'''
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import ast

    results = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert results["decode"] == "RuntimeError: boom"
    assert {k: v for k, v in results.items() if k != "decode"} == dict.fromkeys(
        ("store_kv", "prefill", "add_rms_norm", "rotary", "sampling"), "FAIL")
