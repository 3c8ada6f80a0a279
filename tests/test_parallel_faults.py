"""Tensor parallelism's edges: refusals before any process starts, ranks that disagree, a worker that dies or
raises, a parent that dies, and the torchrun launch."""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from optimized import LLM, SamplingParams
from optimized.engine import assembly
from optimized.engine.assembly import RunnerSpec
from optimized.engine.model_runner import StepMessage
from optimized.parallel import launch
from optimized.parallel.group import Group, TensorParallelError, open_store, private_store
from optimized.parallel.step import receive_step, send_step, send_stop
from tests.engine_fixtures import checkpoint, with_config

pytestmark = pytest.mark.usefixtures("engine_env")
ROOT = Path(__file__).resolve().parent.parent
SMALL: dict[str, Any] = {"dtype": "float64", "kvcache_block_size": 4, "num_kvcache_blocks": 32}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def _child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(spec: RunnerSpec) -> Group:
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
        LLM(str(path), tensor_parallel_size=size, **SMALL)


@pytest.mark.clause("TP-1")
def test_too_few_cuda_devices_refused(no_spawn: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """TP-1: on CUDA, fewer devices than ranks is refused by name before any worker starts."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 CUDA devices, this machine has 1"):
        LLM(str(checkpoint("qwen3")), device="cuda", attention_backend="torch", tensor_parallel_size=2)


def _refuse_join(spec: RunnerSpec, rank: int) -> Group:
    raise AssertionError("the torchrun group was joined before the refusal")


@pytest.mark.clause("TP-1", "TP-8")
def test_torchrun_world_of_another_size_refused(no_spawn: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """TP-1, TP-8: under torchrun, a WORLD_SIZE other than tensor_parallel_size is refused before joining."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(launch, "_join_torchrun", _refuse_join)
    with pytest.raises(ValueError, match="tensor_parallel_size=2, but torchrun started WORLD_SIZE=3"):
        LLM(str(checkpoint("qwen3")), tensor_parallel_size=2, **SMALL)


@pytest.mark.clause("TP-2")
def test_size_one_under_torchrun_joins_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """TP-2: tensor_parallel_size=1 under torchrun is a single-process engine in each process: no group is joined."""
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(launch, "_join_torchrun", _refuse_join)
    llm = LLM(str(checkpoint("qwen3")), **SMALL)
    assert llm.engine.runner.tp is None and llm.comm_stats() is None
    assert len(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].token_ids) == 6


def _spec(family: str, **changes: Any) -> RunnerSpec:
    base = RunnerSpec(str(checkpoint(family)), "float64", "cpu", "torch", 4, 32, 0.9, 0.5, 64, 8, True, 2, 1)
    return RunnerSpec(**{**base.__dict__, **changes})


def _group(llm: LLM) -> Group:
    """Rank 0's group of a tensor-parallel LLM."""
    group = llm._group
    assert group is not None
    return group


def _on_two_ranks(work: Callable[[Group], Any], timeout: float = 30) -> tuple[list[Any], list[BaseException | None]]:
    """``work(group)`` on ranks 0 and 1 (daemon threads named rank0 and rank1 of this process) over a real gloo
    group and a private store; each rank's result and exception. Every group is ended (aborted) afterwards, so a
    rank stuck in a collective fails at once instead of hanging the run."""
    store, folder = private_store()
    results: list[Any] = [None, None]
    errors: list[BaseException | None] = [None, None]
    groups: list[Group] = []

    def rank(r: int) -> None:
        try:
            groups.append(group := Group(store if r == 0 else open_store(folder), r, 2, torch.device("cpu")))
            results[r] = work(group)
        except BaseException as e:  # handed to the test
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}", daemon=True) for r in (0, 1)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=timeout)
    finally:  # a finished rank's group ends (its connections close): a rank stuck waiting on it fails at once
        for group in groups:
            if group.failure is None and not threads[group.rank].is_alive():
                group.end("the test is over")
        for t in threads:
            t.join(timeout=5)
        shutil.rmtree(folder, ignore_errors=True)
    assert not any(t.is_alive() for t in threads), "a rank did not finish in time"
    return results, errors


def _check_pair(spec0: RunnerSpec, spec1: RunnerSpec) -> list[BaseException | None]:
    """check_same run by two ranks over a real gloo group; each rank's exception."""
    return _on_two_ranks(lambda group: launch.check_same(group, (spec0, spec1)[group.rank]))[1]


def _same_shapes_other_weights(folder: Path) -> Path:
    """A copy of the qwen3 checkpoint with one weight changed: the same config, file names, sizes and header."""
    from safetensors.torch import load_file, save_file

    if not folder.exists():
        shutil.copytree(checkpoint("qwen3"), folder)
        path = folder / "model.safetensors"
        weights = load_file(str(path))
        weights["model.norm.weight"][0] += 1.0
        save_file(weights, str(path), metadata={"format": "pt"})
    return folder


@pytest.mark.clause("TP-8")
def test_ranks_that_disagree_are_refused(tmp_path: Path) -> None:
    """TP-8: ranks loading different checkpoints (even of the same shapes, other weights), or with different
    settings, refuse on every rank, naming the rank and what differs; ranks that agree pass."""
    same_shapes = _spec("qwen3", model=str(_same_shapes_other_weights(tmp_path / "other-weights")))
    assert launch._setup(same_shapes)["checkpoint files"] == launch._setup(_spec("qwen3"))["checkpoint files"]
    assert _check_pair(_spec("qwen3"), _spec("qwen3")) == [None, None]
    for other, field in ((_spec("llama"), "checkpoint files"), (same_shapes, "checkpoint sampled sha256"),
                         (_spec("qwen3", kvcache_block_size=8), "kvcache_block_size")):
        errors = _check_pair(_spec("qwen3"), other)
        for e in errors:
            assert isinstance(e, ValueError)
            assert f"tensor-parallel rank 1 has {field}" in str(e)


@pytest.mark.clause("TP-9", "TP-3")
def test_killed_worker_fails_the_next_step_naming_it() -> None:
    """TP-9, TP-3: a worker killed with SIGKILL makes the next step fail on rank 0 within seconds, naming rank 1 and
    the signal; every later step fails the same way at once; close() then has nothing left to stop."""
    llm = LLM(str(checkpoint("qwen3")), tensor_parallel_size=2, **SMALL)
    assert len(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].token_ids) == 6
    group = _group(llm)
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


@pytest.mark.clause("TP-9")
def test_worker_that_raises_sends_its_exception_to_rank_0(tmp_path: Path) -> None:
    """TP-9: a worker whose shard holds a NaN (rank 1's half of a q_proj) raises while loading; rank 0 reports its
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
    print(llm._group.store_folder, *(w.pid for w in llm._group.workers), flush=True)
    time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a zombie has exited; only its exit status waits for a reaper


@pytest.mark.clause("TP-2", "TP-3")
def test_workers_exit_when_the_parent_is_killed(tmp_path: Path) -> None:
    """TP-3: kill -9 the process holding rank 0, and its workers exit by themselves within seconds, removing the
    private store's folder (TP-2) that rank 0 no longer can."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    proc = subprocess.Popen([sys.executable, str(script), str(checkpoint("qwen3"))], stdout=subprocess.PIPE,
                            env=_child_env(), text=True)
    pids: list[int] = []
    try:
        folder, *words = _line_within(proc, 60).split()
        pids = [int(p) for p in words]
        assert len(pids) == 1 and not _gone(pids[0]) and Path(folder).is_dir()
        proc.kill()
        proc.wait(timeout=10)
        assert _all_gone(pids, within=10)
        assert not Path(folder).exists()
    finally:
        _kill_all(proc, pids)


def _line_within(proc: subprocess.Popen[str], seconds: float) -> str:
    """The child's first line of output, or a failure after ``seconds`` (never a hang)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], seconds)
    assert ready, f"no output within {seconds} s"
    return proc.stdout.readline()


def _kill_all(parent: subprocess.Popen[str], pids: list[int]) -> None:
    """The test's parent process and the workers it reported, whatever is left of them."""
    parent.kill()
    parent.wait(timeout=10)
    for pid in pids:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def _all_gone(pids: list[int], within: float) -> bool:
    deadline = time.monotonic() + within
    while not all(map(_gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return all(map(_gone, pids))


@pytest.mark.clause("TP-2")
def test_torchrun_two_ranks_generate_what_one_process_does() -> None:
    """TP-2: ``torchrun --nproc-per-node 2 -m optimized.cli generate --tensor-parallel-size 2`` (rank 1 becomes a
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


@pytest.mark.clause("TP-4")
def test_memory_check_counts_only_the_ranks_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    """TP-4: a model too large for the device whole, but whose half fits, is admitted on each of two ranks; the
    refusal, when even the piece does not fit, says it is the rank's piece."""
    from optimized.models import loader
    from optimized.models.config import load_config
    from optimized.models.sharding import Shard

    c = load_config(checkpoint("llama"))
    cpu = torch.device("cpu")
    whole = loader._bytes_needed(c, torch.float64)
    half = loader._bytes_needed(Shard(0, 2).local_config(c), torch.float64)
    assert half < whole
    monkeypatch.setattr(loader, "_device_memory", lambda device: half)
    with pytest.raises(ValueError, match="need"):
        loader.check_fits(c, torch.float64, cpu)
    for rank in (0, 1):
        loader.check_fits(c, torch.float64, cpu, Shard(rank, 2))
    monkeypatch.setattr(loader, "_device_memory", lambda device: half - 1)
    with pytest.raises(ValueError, match="for rank 1's piece of 2, more than this machine's"):
        loader.check_fits(c, torch.float64, cpu, Shard(1, 2))


class _SliceRecorder:
    """A ``safe_open`` handle that records what is read: whole tensors by name, pieces as (name, rows, columns)."""

    def __init__(self, handle: Any, wholes: list[str], pieces: list[tuple[str, Any]]) -> None:
        self.handle, self.wholes, self.pieces = handle, wholes, pieces

    def keys(self) -> Any:
        return self.handle.keys()

    def get_tensor(self, name: str) -> Any:
        self.wholes.append(name)
        return self.handle.get_tensor(name)

    def get_slice(self, name: str) -> Any:
        recorder, whole = self, self.handle.get_slice(name)

        class Piece:
            def __getitem__(self, index: Any) -> Any:
                recorder.pieces.append((name, index))
                return whole[index]

        return Piece()


@pytest.mark.clause("TP-4")
def test_a_rank_reads_only_its_own_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """TP-4: loading rank 1's shard reads every split tensor through a slice of exactly its own rows or columns,
    never whole; only the tensors every rank holds whole (norms, a row-parallel bias) are read whole."""
    from types import SimpleNamespace

    from safetensors import safe_open

    from optimized.models import loader
    from optimized.models.config import load_config
    from optimized.models.sharding import Shard, source_slice

    wholes: list[str] = []
    pieces: list[tuple[str, Any]] = []
    @contextlib.contextmanager
    def recording(*args: Any, **kwargs: Any) -> Any:
        with safe_open(*args, **kwargs) as handle:
            yield _SliceRecorder(handle, wholes, pieces)

    monkeypatch.setattr(loader, "safe_open", recording)
    folder = checkpoint("qwen3")
    c, shard = load_config(folder), Shard(1, 2)
    loader.load_model(folder, torch.float64, torch.device("cpu"), SimpleNamespace(shard=shard))
    assert wholes and pieces
    for name in wholes:
        assert source_slice(shard, c, name) is None, name
    for name, index in pieces:
        part = source_slice(shard, c, name)
        assert part is not None, name
        dim, start, end = part
        wanted = slice(start, end) if dim == 0 else (slice(None), slice(start, end))
        assert index == wanted, (name, index)


class _FailingRunner:
    def forward(self, step: StepMessage) -> None:
        raise ValueError(f"no forward for {len(step.input_ids)} tokens")


@pytest.mark.clause("TP-7", "TP-9")
def test_worker_that_raises_in_a_step_sends_its_exception_to_rank_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """TP-7, TP-9: a worker (here a thread of this process running the real serve loop over a real gloo group)
    receives rank 0's step, raises in its forward, and rank 0's next collective fails at once with that exception's
    text, naming rank 1; the worker's loop ends with status 1."""
    monkeypatch.setattr(launch, "build_runner", lambda spec, group: _FailingRunner())
    ids = np.array([5, 6, 7], dtype=np.int64)
    step = StepMessage(True, False, ids, ids, ids, np.array([0, 3]), np.array([3]), np.zeros((1, 1), dtype=np.int64),
                       np.array([2]))

    def rank(group: Group) -> float | int:
        if group.rank == 1:
            return launch.serve(group, _spec("qwen3"))
        send_step(group, step)
        start = time.monotonic()
        with pytest.raises(TensorParallelError,
                           match="tensor-parallel rank 1 raised ValueError: no forward for 3 tokens"):
            group.gather_columns(torch.zeros(1, 4))
        return time.monotonic() - start

    (waited, status), errors = _on_two_ranks(rank)
    assert errors == [None, None]
    assert waited < 10 and status == 1


@pytest.mark.clause("TP-7")
def test_step_message_crosses_whole() -> None:
    """TP-7: a worker receives exactly rank 0's step (prefill or decode, the graphed flag, every array), and the stop
    message ends its loop."""
    ids = np.array([5, 6, 7, 8], dtype=np.int64)
    tables = np.array([[3, 4, -1], [7, -1, -1]], dtype=np.int64)
    sent = [StepMessage(False, True, ids[:2], ids[2:], ids[:2] + 10, np.array([0, 1, 2]), np.array([9, 3]), tables,
                        np.array([0, 1])),
            StepMessage(True, False, ids, ids + 1, ids + 2, np.array([0, 4]), np.array([4]), tables[:1], np.array([3]))]

    def rank(group: Group) -> list[StepMessage | None]:
        if group.rank == 0:
            for m in sent:
                send_step(group, m)
            send_stop(group)
            return []
        return [receive_step(group) for _ in range(3)]

    (_, got), errors = _on_two_ranks(rank)
    assert errors == [None, None] and got[2] is None
    for mine, theirs in zip(sent, got[:2], strict=True):
        assert theirs is not None
        assert (theirs.is_prefill, theirs.graphed) == (mine.is_prefill, mine.graphed)
        for field in ("input_ids", "positions", "slot_mapping", "cu_seqlens_q", "context_lens", "block_tables",
                      "logit_rows"):
            assert np.array_equal(getattr(theirs, field), getattr(mine, field)), field


# Rank 0 raising, the private store, the start, the timeouts -----------------------------------------------------


class _RaisesOnce(torch.nn.Module):
    """A decoder layer that raises on its first call (rank 0's forward, after the step went to the workers)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.raised = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.raised:
            self.raised = True
            raise ValueError("rank 0's layer broke")
        return self.layer(*args, **kwargs)


@pytest.mark.clause("TP-9")
def test_rank_0_that_raises_ends_the_group_at_once() -> None:
    """TP-9: rank 0's own forward raising after the step went out fails the call within moments naming rank 0 (the
    engine fails the batch, FAULT-1), kills the worker (no collective timeout waited out), and every later call fails
    at once with the same message."""
    llm = LLM(str(checkpoint("qwen3")), tensor_parallel_size=2, **SMALL)
    runner, group = llm.engine.runner, _group(llm)
    runner.model.layers[1] = _RaisesOnce(runner.model.layers[1])
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="tensor-parallel rank 0 raised ValueError: rank 0's layer broke"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 5
    assert [w.exitcode for w in group.workers] == [-signal.SIGKILL]  # killed, not left in the all-reduce
    assert llm.engine.stats.failed_steps == 1
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="tensor-parallel rank 0 raised ValueError"):
        llm.generate([[4, 5]], GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 1
    llm.close()


def _sockets_listening(pid: int) -> dict[int, str]:
    """The listening TCP sockets process ``pid`` holds: inode -> local address (hex, as /proc/net/tcp* writes)."""
    mine = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:["):
                mine.add(int(link[8:-1]))
    found = {}
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and int(cols[9]) in mine:  # 0A: LISTEN
                found[int(cols[9])] = cols[1].split(":")[0]
    return found


def _loopback(address: str) -> bool:
    """127.0.0.0/8 (IPv4, or IPv4-mapped IPv6) or ::1, in /proc/net/tcp*'s little-endian hex."""
    if len(address) == 8:
        return address.endswith("7F")
    return address == "00000000000000000000000001000000" or (
        address.startswith("0000000000000000FFFF0000") and address.endswith("7F"))


@pytest.mark.clause("TP-2", "TP-3")
def test_private_store_and_dropped_llm_stops_its_worker() -> None:
    """TP-2: the spawned group's rendezvous store is a file in a folder only this user may enter (0700), and no
    process of the group listens on an address other than the loopback (nothing another machine can reach).
    TP-3: an LLM dropped without close() (garbage collected) still stops its worker, which exits with 0, and the
    store's folder is removed."""
    import gc

    before = set(_sockets_listening(os.getpid()))
    llm = LLM(str(checkpoint("qwen3")), tensor_parallel_size=2, **SMALL)
    group = _group(llm)
    assert group.store_folder is not None
    folder = group.store_folder
    assert folder.stat().st_mode & 0o777 == 0o700 and (folder / "store").is_file()
    worker = group.workers[0]
    listening = {**_sockets_listening(worker.pid or 0),
                 **{k: v for k, v in _sockets_listening(os.getpid()).items() if k not in before}}
    assert all(map(_loopback, listening.values())), listening
    del llm, group
    gc.collect()
    worker.join(timeout=15)
    assert worker.exitcode == 0
    assert not folder.exists()


def _slow_rank_1(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Rank 1 (the thread named rank1) loads its shard ``seconds`` late and its memory holds 5 KV blocks, rank 0's 9."""
    from optimized.models import loader

    load = loader.load_model

    def slow_load(*args: Any) -> Any:
        if threading.current_thread().name == "rank1":
            time.sleep(seconds)
        return load(*args)

    monkeypatch.setattr(loader, "load_model", slow_load)
    monkeypatch.setattr(assembly, "kv_cache_blocks", lambda *a: 5 if threading.current_thread().name == "rank1" else 9)


@pytest.mark.clause("TP-5", "TP-9")
def test_slow_shard_load_waits_for_the_start_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """TP-9: a rank loading its shard for longer than a collective may take still starts (the start has its own,
    longer timeout); TP-5: every rank gets the least of the ranks' KV block budgets (5 of 9 and 5)."""
    _slow_rank_1(monkeypatch, 1.5)
    monkeypatch.setenv("NANOVERIFY_TP_TIMEOUT", "0.8")
    spec = _spec("qwen3", num_kvcache_blocks=None)
    runners, errors = _on_two_ranks(lambda group: launch.build_runner(spec, group))
    assert errors == [None, None]
    assert [r.num_blocks for r in runners] == [5, 5]


@pytest.mark.clause("TP-9")
def test_rank_too_slow_to_start_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """TP-9: a rank that has not loaded its shard within NANOVERIFY_TP_START_TIMEOUT fails the start on rank 0 with
    an error naming that rank and the variable; the slow rank then stops too."""
    _slow_rank_1(monkeypatch, 0.8)
    monkeypatch.setenv("NANOVERIFY_TP_START_TIMEOUT", "0.2")
    _, errors = _on_two_ranks(lambda group: launch.build_runner(_spec("qwen3"), group))
    assert isinstance(errors[0], TensorParallelError)
    assert "tensor-parallel rank 1 did not load its shard within 0.2 s (NANOVERIFY_TP_START_TIMEOUT)" in str(errors[0])
    assert isinstance(errors[1], TensorParallelError)


@pytest.mark.clause("TP-5")
def test_agree_min_gives_every_rank_the_least() -> None:
    """TP-5: the all-reduce of the minimum gives each rank the least of the ranks' values."""
    results, errors = _on_two_ranks(lambda group: group.agree_min(7 if group.rank == 0 else 3))
    assert errors == [None, None] and results == [3, 3]


@pytest.mark.clause("TP-7")
@pytest.mark.parametrize("variable", ["NANOVERIFY_TP_TIMEOUT", "NANOVERIFY_TP_START_TIMEOUT"])
def test_timeouts_refused_by_name(no_spawn: None, monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    """TP-7: a timeout variable that is not a finite positive number of seconds is a ValueError naming it, read when
    the LLM is made (not when the package is imported), before any process starts; a good value is taken."""
    from optimized.parallel.group import collective_timeout, start_timeout

    for bad in ("abc", "0", "-1", "inf", "nan", ""):
        monkeypatch.setenv(variable, bad)
        with pytest.raises(ValueError, match=f"{variable} must be a finite positive number of seconds"):
            LLM(str(checkpoint("qwen3")), tensor_parallel_size=2, **SMALL)
    monkeypatch.setenv(variable, "2.5")
    read = collective_timeout if variable == "NANOVERIFY_TP_TIMEOUT" else start_timeout
    assert read().total_seconds() == 2.5


@pytest.mark.clause("TP-1")
def test_bad_rank_variable_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """TP-1: a torchrun RANK that is not a non-negative integer is a ValueError naming RANK."""
    for key, value in {"RANK": "one", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="RANK must be a non-negative integer"):
        launch.torchrun_rank()


@pytest.mark.clause("TP-1")
@pytest.mark.parametrize("case", ["header", "memory", "blocks"])
def test_checkpoint_and_memory_refused_before_any_process(
    no_spawn: None, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """TP-1: a checkpoint whose headers do not hold the model, a model whose rank's piece does not fit (CKPT-5), and
    num_kvcache_blocks beyond this machine's memory are refused by name before any worker starts."""
    from optimized.models import loader

    folder, blocks = checkpoint("qwen3"), 32
    if case == "header":
        folder, message = with_config("qwen3", "h96", hidden_size=96), "has shape"
    elif case == "memory":
        monkeypatch.setattr(loader, "_device_memory", lambda device: 1000)
        message = "for rank 0's piece of 2, more than this machine's 1000"
    else:
        blocks, message = 10**12, "num_kvcache_blocks=1000000000000 needs"
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), tensor_parallel_size=2, **{**SMALL, "num_kvcache_blocks": blocks})


@pytest.mark.clause("TP-8")
def test_sampled_digest_covers_header_and_spread_blocks(tmp_path: Path) -> None:
    """TP-8: a large file's digest covers its header and 16 blocks of 64 KiB spread over it, first and last
    included: a change there is seen; a change between the blocks is not (what the sampling trades)."""
    size = 40 * launch.SAMPLE_BYTES
    data = bytearray(os.urandom(size))
    data[:8] = (100).to_bytes(8, "little")
    path = tmp_path / "big.safetensors"

    def digest_with(offset: int) -> str:
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        path.write_bytes(changed)
        return launch.sampled_digest(path)

    path.write_bytes(data)
    base = launch.sampled_digest(path)
    step = (size - launch.SAMPLE_BYTES) // (launch.SAMPLES - 1)
    for offset in (20, 8 + 99, 5 * step + 7, size - 1):  # header length, header, a sampled block, the last byte
        assert digest_with(offset) != base, offset
    assert digest_with(step - 1) == base  # between the first and the second block


WATCHED = """
import importlib.util, subprocess, sys, time
grandchild = '''
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("watchdog", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.watch_parent(os.getppid())
print("watching", flush=True)
time.sleep(60)
'''
proc = subprocess.Popen([sys.executable, "-c", grandchild, sys.argv[1]], stdout=subprocess.PIPE, text=True)
assert proc.stdout.readline() == "watching\\n"
print(proc.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.clause("TP-3")
def test_parent_watchdog_ends_an_orphan() -> None:
    """TP-3: a process running the parent watchdog (a bare interpreter, no sockets to notice anything through)
    exits within about a second of its parent being killed with SIGKILL."""
    watchdog = ROOT / "optimized" / "parallel" / "watchdog.py"
    child = subprocess.Popen([sys.executable, "-c", WATCHED, str(watchdog)], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = [int(_line_within(child, 30))]
        assert not _gone(pids[0])
        child.kill()
        child.wait(timeout=10)
        assert _all_gone(pids, within=2)
    finally:
        _kill_all(child, pids)
