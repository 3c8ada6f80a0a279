"""The stages of ``nanoverify gpu-check``, each run in its own process: ``python -m optimized.benchmarks.gpu_stages``.

Invariants: a stage reads only its profile and the shared work folder (where the checkpoint stage leaves the bench
checkpoint), and ends by writing one JSON object ``{"status", "summary", "metrics"}`` to ``--out``; status is PASS
or FAIL (a measurement that ran and whose own sanity checks held is a PASS). A stage that crashes, hangs or runs
out of time writes nothing, and the orchestrator (optimized/benchmarks/gpu_check.py) reports that in its row;
running each stage in a fresh process means a CUDA fault or a leak in one cannot spoil the others' numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optimized.benchmarks.gpu_profile import PROFILES, BenchWorkload, Profile, profile_for

if TYPE_CHECKING:
    import torch

    from optimized.entry.llm import LLM

Result = dict[str, Any]
BENCH_DIR = "bench-model"


def result(ok: bool, summary: str, **metrics: Any) -> Result:
    return {"status": "PASS" if ok else "FAIL", "summary": summary, "metrics": metrics}


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _dtype(name: str) -> torch.dtype:
    from optimized.engine.assembly import torch_dtype

    return torch_dtype(name)


def bench_requests(w: BenchWorkload, vocab: int) -> tuple[list[list[int]], list[int]]:
    """nano-vllm bench.py's workload: random prompt tokens, prompt and output lengths uniform in [min, max]."""
    rng = random.Random(w.seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(w.min_len, w.max_len))]
               for _ in range(w.num_requests)]
    return prompts, [rng.randint(w.min_len, w.max_len) for _ in range(w.num_requests)]


def human_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def blocks_for(lengths: list[int], block_size: int) -> int:
    """KV blocks for every request at once (no preemption), plus a block each of slack."""
    return sum(-(-n // block_size) + 1 for n in lengths)


# ---- kernels: the pytest suite under tests/kernels, compiled on a GPU -------------------------------------------


def _junit_counts(path: Path) -> dict[str, int]:
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in ET.parse(path).getroot().iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, "0"))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def _kernel_pytest(p: Profile, work: Path, name: str, args: tuple[str, ...], note: str) -> Result:
    """pytest ``args`` on the profile's device (Triton compiled on CUDA, interpreted on the CPU), judged by GPU-2."""
    import importlib.util

    tests = Path(args[0])
    if not tests.exists():
        return result(False, f"no {tests} under {Path.cwd()} (run from the repository root)")
    if importlib.util.find_spec("pytest") is None:
        return result(False, "pytest is not installed, so the kernel tests cannot run")
    junit, probe = work / f"{name}-junit.xml", work / f"{name}-probe.json"
    interpret = "0" if p.device == "cuda" else "1"
    env = {**os.environ, "TRITON_INTERPRET": interpret, "NANOVERIFY_KERNEL_DEVICE": p.device,
           "NANOVERIFY_PROBE_OUT": str(probe)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.kernel_probe",
           f"--junitxml={junit}", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (work / f"{name}-pytest.log").write_text(proc.stdout + proc.stderr)
    if not junit.is_file() or not probe.is_file():
        return result(False, f"pytest exited {proc.returncode} without a report: {proc.stderr.strip()[-200:]}")
    c = _junit_counts(junit)
    seen = json.loads(probe.read_text())
    compiled = bool(seen["triton_compiled"])
    ok, verdict = kernels_verdict(c, compiled, str(seen["triton_interpret"]), p.device)
    return result(ok, f"{verdict}; {note}", **c, triton_compiled=compiled)


def stage_kernels(p: Profile, work: Path) -> Result:
    return _kernel_pytest(p, work, "kernels", p.kernel_pytest_args, p.kernel_pytest_note)


def stage_kernels_invariant(p: Profile, work: Path) -> Result:
    """GPU-4: the Triton kernels' batch-invariance properties (KERN-28, KERN-29), on the device."""
    selection = " ".join(p.invariant_pytest_args[1:]) or "the whole file"
    return _kernel_pytest(p, work, "kernels-invariant", p.invariant_pytest_args,
                          f"Triton batch invariance, KERN-28/29 ({selection})")


def kernels_verdict(c: dict[str, int], compiled: bool, interpret: str, device: str) -> tuple[bool, str]:
    """GPU-2: nothing failed, something passed, and on CUDA the kernels really were compiled."""
    mode = "Triton compiled" if compiled else f"Triton interpreted (TRITON_INTERPRET={interpret})"
    summary = f"{c['passed']} passed, {c['failures'] + c['errors']} failed, {c['skipped']} skipped; {mode}"
    ok = c["failures"] + c["errors"] == 0 and c["passed"] > 0
    if device == "cuda" and not compiled:
        ok = False
        summary += "; tests/kernels/conftest.py forced the interpreter, so this was not a GPU run"
    return ok, summary


# ---- kernels-direct: each Triton kernel against torch at the bench model's shapes ------------------------------


def stage_kernels_direct(p: Profile, work: Path) -> Result:
    import torch

    from optimized.benchmarks.kernel_direct import KernelCase, run_checks

    device = torch.device(p.device)
    contexts = (1, 17, 300, 1024, 0, 2047) if p.name == "gpu" else (1, 7, 0, 20)
    out: dict[str, str] = {}
    for dtype_name in dict.fromkeys((p.bench_dtype, "float32")):
        case = KernelCase(p.bench_model, _dtype(dtype_name), device, 16 if p.name == "gpu" else 4, contexts,
                          torch.Generator(device=device).manual_seed(5))
        out.update({f"{name}/{dtype_name}": r for name, r in run_checks(case).items()})
    bad = {k: v for k, v in out.items() if v != "pass"}
    s = p.bench_model
    where = f"h={s.heads} kvh={s.kv_heads} d={s.head_dim} hidden={s.hidden}, contexts {list(contexts)}"
    summary = f"{len(out) - len(bad)}/{len(out)} kernel checks equal torch ({where})"
    if bad:
        summary += "; " + "; ".join(f"{k}: {v}" for k, v in bad.items())
    return result(not bad, summary, checks=out)


# ---- graphs-exact: eager and CUDA graphs give the same greedy tokens -------------------------------------------


def graph_info(llm: LLM) -> tuple[bool, int]:
    """Whether decode ran through graphs (some decode step was served by them), and how many bucket graphs were
    captured."""
    steps, captured = llm.decode_graphs()
    return steps > 0, captured


def _free(device: torch.device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def token_diffs(batch: int, eager: list[list[int]], graphs: list[list[int]]) -> list[str]:
    """One line per request whose graph tokens differ from its eager tokens, naming the first differing token."""
    diffs = []
    for i, (e, g) in enumerate(zip(eager, graphs, strict=True)):
        if e != g:
            at = next((j for j, (x, y) in enumerate(zip(e, g, strict=False)) if x != y), min(len(e), len(g)))
            diffs.append(f"B={batch} request {i} differs from token {at}")
    return diffs


def stage_graphs_exact(p: Profile, work: Path) -> Result:
    import torch

    from optimized.benchmarks.random_checkpoint import write_random_checkpoint
    from optimized.engine.sampling_params import SamplingParams
    from optimized.entry.llm import LLM

    device = torch.device(p.device)
    folder = work / "exact-model"
    write_random_checkpoint(folder, p.exact_model, _dtype(p.exact_dtype), device, seed=11)
    rng = random.Random(3)
    cases = {b: [[rng.randrange(p.exact_model.vocab) for _ in range(rng.randint(2, 40))] for _ in range(b)]
             for b in p.exact_batches}
    params = SamplingParams(temperature=0.0, max_tokens=p.exact_max_tokens, ignore_eos=True)
    lengths = [len(x) + p.exact_max_tokens for prompts in cases.values() for x in prompts]
    outputs: dict[bool, dict[int, list[list[int]]]] = {}
    graphs = (False, 0)
    for eager in (True, False):
        llm = LLM(str(folder), dtype=p.exact_dtype, device=p.device, enforce_eager=eager,
                  num_kvcache_blocks=blocks_for(lengths, 16), max_num_seqs=max(p.exact_batches), max_model_len=128)
        outputs[eager] = {b: [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
                          for b, prompts in cases.items()}
        if not eager:
            graphs = graph_info(llm)
        del llm
        _free(device)
    diffs = [d for b in p.exact_batches for d in token_diffs(b, outputs[True][b], outputs[False][b])]
    tokens = sum(len(t) for per in outputs[True].values() for t in per)
    batches = ",".join(map(str, p.exact_batches))
    summary = f"greedy {p.exact_dtype}: B={batches}, {tokens} tokens, {len(diffs)} requests differ"
    summary += f"; graph buckets captured: {graphs[1]}" if graphs[0] else "; NO decode step ran through graphs"
    if diffs:
        summary += " (" + "; ".join(diffs[:3]) + ")"
    return result(graphs[0] and graphs[1] > 0 and not diffs, summary, tokens=tokens, differing=len(diffs),
                  graph_buckets=graphs[1])


# ---- checkpoint: the Qwen3-0.6B-shaped bench checkpoint, made and loaded through the normal loader -------------


def stage_checkpoint(p: Profile, work: Path) -> Result:
    import torch

    from optimized.benchmarks.random_checkpoint import num_parameters, write_random_checkpoint
    from optimized.models.loader import load_model

    device, dtype = torch.device(p.device), _dtype(p.bench_dtype)
    folder = work / BENCH_DIR
    start = time.perf_counter()
    size = write_random_checkpoint(folder, p.bench_model, dtype, device, seed=7)
    written = time.perf_counter() - start
    start = time.perf_counter()
    model = load_model(folder, dtype, device)
    _sync(device)
    loaded = time.perf_counter() - start
    params = len({t.data_ptr(): 0 for t in model.parameters()})
    count = sum({t.data_ptr(): t.numel() for t in model.parameters()}.values())
    expected = num_parameters(p.bench_model)
    summary = (f"{count / 1e6:.1f}M params ({params} tensors), {human_bytes(size)} safetensors written in "
               f"{written:.1f} s, loaded through optimized.models.loader in {loaded:.1f} s")
    if count != expected:
        summary += f"; expected {expected} parameters"
    return result(count == expected, summary, parameters=count, bytes=size, write_s=written, load_s=loaded)


def _bench_folder(work: Path) -> Path:
    folder = work / BENCH_DIR
    if not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(f"no bench checkpoint in {folder}")
    return folder


# ---- engine-graphs / engine-eager: nano-vllm's bench workload through LLM.generate ------------------------------


def _engine_stage(p: Profile, work: Path, eager: bool) -> Result:
    from optimized.engine.sampling_params import SamplingParams
    from optimized.entry.llm import LLM

    folder = _bench_folder(work)
    w = p.workload
    prompts, outs = bench_requests(w, p.bench_model.vocab)
    lengths = [len(x) + o for x, o in zip(prompts, outs, strict=True)]
    llm = LLM(str(folder), dtype=p.bench_dtype, device=p.device, enforce_eager=eager,
              num_kvcache_blocks=blocks_for(lengths, 16), max_num_seqs=w.num_requests, max_model_len=2 * w.max_len)
    # Warm-up on other prompts of the same lengths, in a batch wide enough that every kernel variant the timed
    # run meets (Triton specialises on argument divisibility) is compiled before the clock starts.
    warm = bench_requests(BenchWorkload(min(64, w.num_requests), w.min_len, w.max_len, seed=w.seed + 1),
                          p.bench_model.vocab)[0]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outs]
    st = llm.stats
    steps0, decode0 = st.steps, st.decode_steps
    _sync(llm.device)
    start = time.perf_counter()
    done = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    graphs = graph_info(llm)
    produced = sum(len(o.token_ids) for o in done)
    tps = produced / seconds
    mode = "eager" if eager else "CUDA graphs" if p.device == "cuda" else "graphs (CPU stand-in)"
    summary = (f"{tps:.0f} output tok/s ({produced} tokens of {w.num_requests} requests in {seconds:.1f} s, "
               f"{st.steps - steps0} steps, {st.decode_steps - decode0} decode), {mode}")
    ok = produced == sum(outs)
    if not eager and not graphs[0]:
        ok = False
        summary += "; NO decode step ran through graphs (enforce_eager=False ran eagerly)"
    elif not eager:
        summary += f", {graphs[1]} buckets"
    return result(ok, summary, tokens_per_s=tps, seconds=seconds, output_tokens=produced,
                  requests=w.num_requests, graphs=graphs[0])


def stage_engine_graphs(p: Profile, work: Path) -> Result:
    return _engine_stage(p, work, eager=False)


def stage_engine_eager(p: Profile, work: Path) -> Result:
    return _engine_stage(p, work, eager=True)


# ---- transformers: the same model and requests through transformers' generate ----------------------------------


def stage_transformers(p: Profile, work: Path) -> Result:
    import torch
    from transformers import AutoModelForCausalLM

    folder = _bench_folder(work)
    device = torch.device(p.device)
    prompts, outs = bench_requests(p.workload, p.bench_model.vocab)
    prompts, outs = prompts[: p.hf_requests], outs[: p.hf_requests]
    model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=_dtype(p.bench_dtype))
    model.to(device)
    model.train(False)

    def batch(rows: list[list[int]], new: int) -> None:
        width = max(len(r) for r in rows)
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=0)

    with torch.inference_mode():
        batch(prompts[:2], 4)  # warm-up
        _sync(device)
        start = time.perf_counter()
        for i in range(0, len(prompts), p.hf_batch):
            batch(prompts[i : i + p.hf_batch], max(outs[i : i + p.hf_batch]))
        _sync(device)
        seconds = time.perf_counter() - start
    tps = sum(outs) / seconds
    summary = (f"{tps:.0f} output tok/s ({sum(outs)} requested tokens of the first {len(prompts)}/"
               f"{p.workload.num_requests} requests, static left-padded batches of {p.hf_batch}, {seconds:.1f} s)")
    return result(True, summary, tokens_per_s=tps, seconds=seconds, requests=len(prompts),
                  output_tokens=sum(outs))


# ---- decode-floor: the decode step at full batch against the memory-bandwidth floor ---------------------------


def stage_decode_floor(p: Profile, work: Path) -> Result:
    import torch

    from optimized.benchmarks.decode_floor import copy_bandwidth, decode_floor, time_decode_steps
    from optimized.entry.llm import LLM

    folder = _bench_folder(work)
    device = torch.device(p.device)
    bandwidth = copy_bandwidth(device, p.copy_bytes)
    prompts = bench_requests(p.workload, p.bench_model.vocab)[0][: p.floor_batch]
    if len(prompts) < p.floor_batch:
        prompts = [prompts[i % len(prompts)] for i in range(p.floor_batch)]
    lengths = [len(x) + p.floor_warmup_steps + p.floor_steps + 2 for x in prompts]
    metrics: dict[str, Any] = {"bandwidth": bandwidth, "batch": p.floor_batch}
    parts = []
    for eager in (False, True):
        llm = LLM(str(folder), dtype=p.bench_dtype, device=p.device, enforce_eager=eager,
                  num_kvcache_blocks=blocks_for(lengths, 16), max_num_seqs=p.floor_batch,
                  max_model_len=max(lengths) + 16)
        steps = time_decode_steps(llm, prompts, p.floor_warmup_steps, p.floor_steps)
        floors = [decode_floor(llm.network(), s.context_lens, bandwidth) for s in steps]
        measured = statistics.median(s.seconds for s in steps)
        floor = statistics.median(f.seconds for f in floors)
        mode = "eager" if eager else "graphs"
        metrics[mode] = {"step_s": measured, "floor_s": floor, "efficiency": floor / measured,
                         "weight_bytes": floors[0].weight_bytes,
                         "kv_read_bytes": statistics.median(f.kv_read_bytes for f in floors)}
        parts.append(f"{mode} {measured * 1e3:.3g} ms (floor/step {100 * floor / measured:.3g}%)")
        del llm, steps
        _free(device)
    g = metrics["graphs"]
    summary = (f"B={p.floor_batch}: " + ", ".join(parts) + f"; floor {g['floor_s'] * 1e3:.3g} ms = (W "
               f"{human_bytes(g['weight_bytes'])} + KV {human_bytes(g['kv_read_bytes'])}) / copy bandwidth "
               f"{human_bytes(bandwidth)}/s")
    # A step faster than its floor would mean the byte count or the bandwidth is wrong.
    sane = all(0.0 < metrics[m]["efficiency"] <= 1.0 for m in ("graphs", "eager"))
    if not sane:
        summary += "; a step beat its floor: the byte count or the bandwidth is wrong"
    return result(sane, summary, **metrics)


STAGE_FUNCTIONS: dict[str, Callable[[Profile, Path], Result]] = {
    "kernels": stage_kernels,
    "kernels-direct": stage_kernels_direct,
    "kernels-invariant": stage_kernels_invariant,
    "graphs-exact": stage_graphs_exact,
    "checkpoint": stage_checkpoint,
    "engine-graphs": stage_engine_graphs,
    "engine-eager": stage_engine_eager,
    "transformers": stage_transformers,
    "decode-floor": stage_decode_floor,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="one stage of nanoverify gpu-check")
    ap.add_argument("stage", choices=sorted(STAGE_FUNCTIONS))
    ap.add_argument("--profile", choices=sorted(PROFILES), required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    profile = profile_for(args.profile == "tiny", args.device)
    outcome = STAGE_FUNCTIONS[args.stage](profile, args.work)
    with tempfile.NamedTemporaryFile("w", dir=args.out.parent, delete=False) as f:
        json.dump(outcome, f)
    os.replace(f.name, args.out)  # the orchestrator never reads half a result
    return 0


if __name__ == "__main__":
    sys.exit(main())
