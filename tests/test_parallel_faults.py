"""Tensor parallelism's edges: refusals before any process starts, ranks that disagree, a worker that dies or
raises, a parent that dies, and the torchrun launch."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch._C._distributed_c10d import TCPStore

from optimized import LLM, SamplingParams
from optimized.parallel import launch
from optimized.parallel.group import COLLECTIVE_TIMEOUT, Group, TensorParallelError
from optimized.parallel.step import StepMessage, send_step
from tests.engine_fixtures import checkpoint, with_config

pytestmark = pytest.mark.usefixtures("engine_env")
ROOT = Path(__file__).resolve().parent.parent
SMALL: dict[str, Any] = {"dtype": "float64", "kvcache_block_size": 4, "num_kvcache_blocks": 32}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def _child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(spec: launch.RunnerSpec) -> Group:
        raise AssertionError("a worker was started before the refusal")

    monkeypatch.setattr(launch, "_spawn", refuse)


@pytest.mark.clause("TP-1")
@pytest.mark.parametrize(
    ("folder", "size", "message"),
    [
        ("qwen3", 0, "tensor_parallel_size must be an integer >= 1"),
        ("qwen3", "2", "tensor_parallel_size must be an integer >= 1"),
        ("qwen3", True, "tensor_parallel_size must be an integer >= 1"),
        ("qwen3", 3, "num_attention_heads=4 is not divisible by 3"),
        ("i130", 4, "intermediate_size=130 is not divisible by 4"),
        ("h12kv3", 2, "num_key_value_heads=3 is neither divisible by 2 nor a divisor of it"),
    ],
)
def test_refused_by_name_before_any_process(no_spawn: None, folder: str, size: object, message: str) -> None:
    """TP-1: a size that is not a positive integer, or that does not split the heads, KV heads or MLP evenly, is a
    ValueError naming the field, before any worker starts."""
    path = {
        "qwen3": checkpoint("qwen3"),
        "i130": with_config("qwen3", "i130", intermediate_size=130),
        "h12kv3": with_config("qwen3", "h12kv3", num_attention_heads=12, num_key_value_heads=3),
    }[folder]
    with pytest.raises(ValueError, match=message):
        LLM(str(path), tensor_parallel_size=size, **SMALL)  # type: ignore[arg-type]


@pytest.mark.clause("TP-1")
def test_too_few_cuda_devices_refused(no_spawn: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """TP-1: on CUDA, fewer devices than ranks is refused by name before any worker starts."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 CUDA devices, this machine has 1"):
        LLM(str(checkpoint("qwen3")), device="cuda", attention_backend="torch", tensor_parallel_size=2)


def _refuse_join(spec: launch.RunnerSpec, rank: int) -> Group:
    raise AssertionError("the torchrun group was joined before the refusal")


@pytest.mark.clause("TP-1", "TP-7")
def test_torchrun_world_of_another_size_refused(no_spawn: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """TP-1, TP-7: under torchrun, a WORLD_SIZE other than tensor_parallel_size is refused before joining."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(launch, "_join_torchrun", _refuse_join)
    with pytest.raises(ValueError, match="tensor_parallel_size=2, but torchrun started WORLD_SIZE=3"):
        LLM(str(checkpoint("qwen3")), tensor_parallel_size=2, **SMALL)


@pytest.mark.clause("TP-6")
def test_size_one_under_torchrun_joins_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """TP-6: tensor_parallel_size=1 under torchrun is a single-process engine in each process: no group is joined."""
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(launch, "_join_torchrun", _refuse_join)
    llm = LLM(str(checkpoint("qwen3")), **SMALL)
    assert llm.engine.runner.tp is None
    assert len(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].token_ids) == 6


def _spec(family: str, **changes: Any) -> launch.RunnerSpec:
    base = launch.RunnerSpec(str(checkpoint(family)), "float64", "cpu", "torch", 4, 32, 0.9, 0.5, 64, 8, True, 2, 1)
    return launch.RunnerSpec(**{**base.__dict__, **changes})


def _check_pair(spec0: launch.RunnerSpec, spec1: launch.RunnerSpec) -> list[BaseException | None]:
    """check_same run by two ranks (threads of this process) over a real gloo group; each rank's exception."""
    store = TCPStore("127.0.0.1", 0, 2, True, COLLECTIVE_TIMEOUT, wait_for_workers=False)
    errors: list[BaseException | None] = [None, None]

    def rank(r: int, spec: launch.RunnerSpec) -> None:
        client = store if r == 0 else TCPStore("127.0.0.1", store.port, 2, False, COLLECTIVE_TIMEOUT)
        try:
            launch.check_same(Group(client, r, 2, torch.device("cpu")), spec)
        except BaseException as e:  # handed to the test
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r, s)) for r, s in enumerate((spec0, spec1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return errors


@pytest.mark.clause("TP-7")
def test_ranks_that_disagree_are_refused() -> None:
    """TP-7: ranks loading different checkpoints, or with different settings, refuse on every rank, naming the rank
    and what differs; ranks that agree pass."""
    assert _check_pair(_spec("qwen3"), _spec("qwen3")) == [None, None]
    for other, field in ((_spec("llama"), "checkpoint files"), (_spec("qwen3", block_size=8), "block_size")):
        errors = _check_pair(_spec("qwen3"), other)
        for e in errors:
            assert isinstance(e, ValueError)
            assert f"tensor-parallel rank 1 has {field}" in str(e)


@pytest.mark.clause("TP-8", "TP-9")
def test_killed_worker_fails_the_next_step_naming_it() -> None:
    """TP-8, TP-9: a worker killed with SIGKILL makes the next step fail on rank 0 within seconds, naming rank 1 and
    the signal; every later step fails the same way at once; close() then has nothing left to stop."""
    llm = LLM(str(checkpoint("qwen3")), tensor_parallel_size=2, **SMALL)
    assert len(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].token_ids) == 6
    group = llm.engine.runner.tp
    assert group is not None
    worker = group.workers[0]
    os.kill(worker.pid or 0, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"tensor-parallel rank 1 \(pid \d+\) was killed by signal 9"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 10
    with pytest.raises(TensorParallelError, match="rank 1"):
        llm.generate([[4, 5]], GREEDY, use_tqdm=False)
    llm.close()
    assert worker.exitcode == -signal.SIGKILL


@pytest.mark.clause("TP-8")
def test_worker_that_raises_sends_its_exception_to_rank_0(tmp_path: Path) -> None:
    """TP-8: a worker whose shard holds a NaN (rank 1's half of a q_proj) raises while loading; rank 0 reports its
    exception text, naming the rank, and no worker is left."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "nan-in-rank-1"
    shutil.copytree(checkpoint("qwen3"), folder)
    path = folder / "model.safetensors"
    weights = load_file(str(path))
    name = "model.layers.1.self_attn.q_proj.weight"
    weights[name][-1, 0] = float("nan")  # the last query head: rank 1's
    save_file(weights, str(path), metadata={"format": "pt"})
    with pytest.raises(TensorParallelError, match=f"tensor-parallel rank 1 raised ValueError: checkpoint tensor "
                                                  f"'{name}' .* holds non-finite values"):
        LLM(str(folder), tensor_parallel_size=2, **SMALL)
    import multiprocessing

    assert not [p for p in multiprocessing.active_children() if p.name.startswith("nanoverify-tp")]


PARENT = """
import sys, time, torch
from optimized import LLM
if __name__ == "__main__":
    torch.set_num_threads(1)
    llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float64", kvcache_block_size=4, num_kvcache_blocks=16)
    print(" ".join(str(w.pid) for w in llm.engine.runner.tp.workers), flush=True)
    time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a zombie has exited; only its exit status waits for a reaper


@pytest.mark.clause("TP-9")
def test_workers_exit_when_the_parent_is_killed(tmp_path: Path) -> None:
    """TP-9: kill -9 the process holding rank 0, and its workers exit by themselves within seconds."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    proc = subprocess.Popen([sys.executable, str(script), str(checkpoint("qwen3"))], stdout=subprocess.PIPE,
                            env=_child_env(), text=True)
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 1 and not _gone(pids[0])
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not all(map(_gone, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(map(_gone, pids))
    finally:
        proc.kill()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.clause("TP-6")
def test_torchrun_two_ranks_generate_what_one_process_does() -> None:
    """TP-6: ``torchrun --nproc-per-node 2 -m optimized.cli generate --tensor-parallel-size 2`` (rank 1 becomes a
    worker by itself) prints exactly what one process prints, greedy in float64 on the default model."""
    prompts = ["hello world", "tensor parallel"]
    cmd = ["-m", "optimized.cli", "generate", *prompts, "--dtype", "float64", "--max-tokens", "10"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = subprocess.run([*torchrun, *cmd, "--tensor-parallel-size", "2"], capture_output=True, text=True,
                         env=_child_env(), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    llm = LLM(None, dtype="float64", num_kvcache_blocks=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    expected = "".join(f"--- {p!r} -> ({len(o.token_ids)} tokens, {o.finish_reason})\n{o.text}\n"
                       for p, o in zip(prompts, outs, strict=True))
    assert out.stdout == expected  # printed once: rank 1 served and printed nothing


@pytest.mark.clause("TP-2")
def test_memory_check_counts_only_the_ranks_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    """TP-2: a model too large for the device whole, but whose half fits, is admitted on each of two ranks; the
    refusal, when even the piece does not fit, says it is the rank's piece."""
    from types import SimpleNamespace

    from optimized.models import loader
    from optimized.models.config import load_config
    from optimized.parallel.sharding import Shard

    c = load_config(checkpoint("llama"))
    cpu = torch.device("cpu")
    whole = loader._bytes_needed(c, torch.float64)
    half = loader._bytes_needed(Shard(0, 2).local_config(c), torch.float64)
    assert half < whole
    monkeypatch.setattr(loader, "_device_memory", lambda device: half)
    with pytest.raises(ValueError, match="need"):
        loader.check_fits(c, torch.float64, cpu)
    for rank in (0, 1):
        loader.check_fits(c, torch.float64, cpu, SimpleNamespace(shard=Shard(rank, 2)))
    monkeypatch.setattr(loader, "_device_memory", lambda device: half - 1)
    with pytest.raises(ValueError, match="for rank 1's piece of 2, more than this machine's"):
        loader.check_fits(c, torch.float64, cpu, SimpleNamespace(shard=Shard(1, 2)))


class _FailingRunner:
    def forward(self, step: StepMessage) -> None:
        raise ValueError(f"no forward for {len(step.input_ids)} tokens")


@pytest.mark.clause("TP-5", "TP-8")
def test_worker_that_raises_in_a_step_sends_its_exception_to_rank_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """TP-5, TP-8: a worker (here a thread of this process running the real serve loop over a real gloo group)
    receives rank 0's step, raises in its forward, and rank 0's next collective fails at once with that exception's
    text, naming rank 1; the worker's loop ends with status 1."""
    monkeypatch.setattr(launch, "build_runner", lambda spec, group: _FailingRunner())
    store = TCPStore("127.0.0.1", 0, 2, True, COLLECTIVE_TIMEOUT, wait_for_workers=False)
    status: list[int] = []

    def worker() -> None:
        client = TCPStore("127.0.0.1", store.port, 2, False, COLLECTIVE_TIMEOUT)
        status.append(launch.serve(Group(client, 1, 2, torch.device("cpu")), _spec("qwen3")))

    thread = threading.Thread(target=worker)
    thread.start()
    rank0 = Group(store, 0, 2, torch.device("cpu"))
    ids = np.array([5, 6, 7], dtype=np.int64)
    send_step(rank0, StepMessage(True, False, ids, ids, ids, np.array([0, 3]), np.array([3]),
                                 np.zeros((1, 1), dtype=np.int64), np.array([2])))
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="tensor-parallel rank 1 raised ValueError: no forward for 3 tokens"):
        rank0.gather_columns(torch.zeros(1, 4))
    assert time.monotonic() - start < 10
    thread.join(timeout=30)
    assert status == [1]


@pytest.mark.clause("TP-9")
def test_dropped_llm_stops_its_worker() -> None:
    """TP-9: an LLM dropped without close() (garbage collected) still stops its worker, which exits with 0."""
    import gc

    llm = LLM(str(checkpoint("qwen3")), tensor_parallel_size=2, **SMALL)
    group = llm.engine.runner.tp
    assert group is not None
    worker = group.workers[0]
    del llm, group
    gc.collect()
    worker.join(timeout=15)
    assert worker.exitcode == 0
