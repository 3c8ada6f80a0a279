"""Starting a tensor-parallel engine: refusals first, then the workers, then each rank's runner (TP-1, TP-2, TP-8).

Invariant: everything that can be refused by name (the size, the model's divisibility, the device count, a torchrun
world of another size, the timeout variables, the checkpoint's headers, rank 0's piece or KV cache not fitting in
memory) is refused before any process starts or any group is joined. Then either rank 0 spawns ``size - 1``
workers (multiprocessing spawn) around a private rendezvous store (a file in a 0700 folder), or, when torchrun set
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``, every rank joins torchrun's ``env://`` store. Every rank
then checks that all ranks agree on the checkpoint and the settings, loads its shard, waits (under the start
timeout) for every rank to have loaded, and sizes its KV cache, the same number of blocks on every rank;
``build_runner`` is that one sequence, run by rank 0 and by every worker alike, so their collectives pair up (its
loading and sizing are ``load_runner``'s of optimized/engine/assembly.py, which a single process runs too). A
worker exits when rank 0 says stop, when a collective with rank 0 fails (rank 0 died or ended the group: its
connections closed), or when its parent process is gone (the watchdog). Rank 0 can also ask between steps,
idle or not, whether a worker it spawned has exited (``group_fault``): a server learns of a dead group before
any request finds it (SERVE-19).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
import weakref
from dataclasses import asdict
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
from torch.distributed.rendezvous import rendezvous

from optimized.engine.assembly import RunnerSpec, kv_bytes_per_block, kv_cache_blocks, load_runner, torch_dtype
from optimized.engine.model_runner import ModelRunner
from optimized.models.config import ModelConfig
from optimized.models.sharding import Shard, check_divisible
from optimized.parallel.group import (
    ERROR_KEY,
    Group,
    TensorParallelError,
    collective_timeout,
    open_store,
    private_store,
    start_timeout,
)
from optimized.parallel.step import receive_step, send_stop
from optimized.parallel.watchdog import watch_parent

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_LED: weakref.WeakSet[Group] = weakref.WeakSet()  # the open groups this process leads as rank 0
_JOINED = "nanoverify/joined/"
_SETUP = "nanoverify/setup/"


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (``env://``) launched it, else None."""
    if not all(os.environ.get(k) for k in TORCHRUN_VARIABLES):
        return None
    text = os.environ["RANK"]
    if not text.isdigit():
        raise ValueError(f"the environment variable RANK must be a non-negative integer (torchrun sets it), got "
                         f"{text!r}")
    return int(text)


def check_plan(size: int, c: ModelConfig, device: torch.device) -> None:
    """The refusals that need no process (TP-1): divisibility, the device count, torchrun's world size."""
    if size == 1:
        return
    collective_timeout(), start_timeout()  # their variables, read and refused by name now (TP-7)
    check_divisible(c, size)
    if device.type == "cuda" and torchrun_rank() is None and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size={size} needs {size} CUDA devices, this machine has "
                         f"{torch.cuda.device_count()}")
    if torchrun_rank() is not None:
        world = os.environ["WORLD_SIZE"]
        if world != str(size):
            raise ValueError(f"tensor_parallel_size={size}, but torchrun started WORLD_SIZE={world} processes")


def _device(spec: RunnerSpec, rank: int) -> torch.device:
    if torch.device(spec.device).type != "cuda":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


# Agreement across ranks (TP-8) ---------------------------------------------------------------------------------


SAMPLES, SAMPLE_BYTES = 16, 64 * 1024  # the blocks of a weights file whose sha256 every rank compares


def sampled_digest(path: Path) -> str:
    """sha256 of a safetensors file's header (names, dtypes, shapes, offsets) and of ``SAMPLES`` blocks of
    ``SAMPLE_BYTES`` spread evenly over the file, first and last included (the whole file when it is smaller)."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as f:
        prefix = f.read(8)
        digest.update(prefix)
        if len(prefix) == 8:
            digest.update(f.read(min(int.from_bytes(prefix, "little"), size)))
        if size <= SAMPLES * SAMPLE_BYTES:
            f.seek(0)
            digest.update(f.read())
        else:
            for i in range(SAMPLES):
                f.seek(i * (size - SAMPLE_BYTES) // (SAMPLES - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def _setup(spec: RunnerSpec) -> dict[str, Any]:
    """What every rank must agree on: the checkpoint (config bytes, file names and sizes, each file's sampled
    digest) and the settings."""
    folder = Path(spec.model)
    config = (folder / "config.json").read_bytes()
    paths = sorted(folder.glob("*.safetensors"))
    settings = {k: v for k, v in asdict(spec).items() if k not in ("model", "threads")}
    return {
        "config.json sha256": hashlib.sha256(config).hexdigest(),
        "checkpoint files": [(p.name, p.stat().st_size) for p in paths],
        "checkpoint sampled sha256": [sampled_digest(p) for p in paths],
        **settings,
    }


def check_same(group: Group, spec: RunnerSpec) -> None:
    """Every rank's setup is rank 0's, or a ValueError on every rank naming a rank and the field that differs."""
    mine = _setup(spec)
    text = json.dumps(mine, sort_keys=True)
    group.store.set(f"{_SETUP}{group.rank}", text)
    digests = group.all_gather_bytes(hashlib.sha256(text.encode()).digest())
    for rank, digest in enumerate(digests):
        if digest != digests[0]:
            first = json.loads(bytes(group.store.get(f"{_SETUP}0")).decode())
            other = json.loads(bytes(group.store.get(f"{_SETUP}{rank}")).decode())
            field = next(k for k in first if first[k] != other.get(k))
            raise ValueError(f"tensor-parallel rank {rank} has {field} {other.get(field)!r} where rank 0 has "
                             f"{first[field]!r}: every rank must load the same checkpoint with the same settings")


# Each rank's runner ---------------------------------------------------------------------------------------------


def build_runner(spec: RunnerSpec, group: Group) -> ModelRunner:
    """This rank's shard, its KV cache (the same block count on every rank) and its runner."""
    check_same(group, spec)

    def agree(blocks: int) -> int:
        group.wait_for_ranks("load its shard", start_timeout())  # a slow rank is named, not a collective timeout
        return group.agree_min(blocks)

    return load_runner(spec, group.device, group, agree)


def engine_runner(spec: RunnerSpec) -> tuple[ModelRunner, Group]:
    """Rank 0's runner and group, its workers started (spawned, or joined under torchrun); ``close(group)`` stops
    them. On a torchrun rank other than 0 this serves rank 0 until it stops and then exits the process (TP-2): it
    never returns there."""
    rank = torchrun_rank()
    check_before_start(spec)
    group = _join_torchrun(spec, rank) if rank is not None else _spawn(spec)
    if group.rank != 0:
        code = serve(group, spec)
        sys.stdout.flush()
        os._exit(code)
    group.threads_before = torch.get_num_threads()
    torch.set_num_threads(spec.threads)  # TP-10: rank 0 runs on its share of the cores, as every worker does
    try:
        runner = build_runner(spec, group)
        _LED.add(group)
        return runner, group
    except TensorParallelError:
        _restore_threads(group)
        raise
    except BaseException:
        group.kill_workers()
        _restore_threads(group)
        raise


def _restore_threads(group: Group) -> None:
    """The caller's thread count back, unless something else changed it since."""
    before = group.threads_before
    if before is not None and torch.get_num_threads() == max(1, before // group.size):
        torch.set_num_threads(before)
    group.threads_before = None


def check_before_start(spec: RunnerSpec) -> None:
    """What this rank can refuse alone, refused before any process starts (TP-1): the checkpoint's headers
    (CKPT-5), its piece's fit in memory (CKPT-5, TP-4) and a ``num_kvcache_blocks`` beyond this machine's memory."""
    from optimized.models.config import load_config
    from optimized.models.loader import check_checkpoint

    folder, dtype, device = Path(spec.model), torch_dtype(spec.dtype), torch.device(spec.device)
    c = load_config(folder)
    shard = Shard(0, spec.tensor_parallel_size)
    check_checkpoint(c, folder, dtype, device, shard)
    if spec.num_kvcache_blocks is not None:
        per_block = kv_bytes_per_block(shard.local_config(c), spec.kvcache_block_size, dtype)
        kv_cache_blocks(device, per_block, spec.num_kvcache_blocks, spec.gpu_memory_utilization,
                        spec.cpu_kvcache_gib)


def close(group: Group | None) -> None:
    """Rank 0: tell the workers to stop and wait for them (killed if they do not exit in time). Idempotent; None
    (no tensor parallelism) has nothing to stop."""
    if group is None:
        return
    _LED.discard(group)
    _restore_threads(group)
    if group.failure is not None:
        return
    with contextlib.suppress(TensorParallelError):  # a worker already gone: the join below finds it
        send_stop(group)
    group.failure = "the LLM was closed"
    group.join_workers(timeout=10)
    # Freed now, while the interpreter is whole: gloo's groups left to the interpreter's exit were seen to abort
    # the process (std::terminate) under torchrun once in a loaded CI run.
    group.compute = group.control = None


def group_fault() -> str | None:
    """Why an open tensor-parallel group this process leads is dead, or None while each is whole: its failure
    (TP-9), or a worker it spawned that has exited, which ends the group now (the rank named, as a step would have
    found it). Call it from the thread that steps the engine, between steps."""
    for group in list(_LED):
        if group.failure is None and any(proc.exitcode is not None for proc in group.workers):
            group.fail(RuntimeError("a tensor-parallel worker exited"))  # names the rank and how it ended
        if group.failure is not None:
            return group.failure
    return None


# Rank 0 spawns the workers --------------------------------------------------------------------------------------


def _spawn(spec: RunnerSpec) -> Group:
    """The workers, around a store in a private folder (TP-2): rank 0's group holds them and the folder."""
    import multiprocessing

    store, folder = private_store()
    ctx = multiprocessing.get_context("spawn")
    procs: list[BaseProcess] = [
        ctx.Process(target=spawned_worker, args=(spec, rank, str(folder), os.getpid()), daemon=True,
                    name=f"nanoverify-tp-rank{rank}")
        for rank in range(1, spec.tensor_parallel_size)
    ]
    try:
        for proc in procs:
            proc.start()
        _wait_joined(store, procs)
        return Group(store, 0, spec.tensor_parallel_size, _device(spec, 0), procs, store_folder=folder)
    except BaseException:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        shutil.rmtree(folder, ignore_errors=True)
        raise


def _wait_joined(store: Any, procs: list[BaseProcess]) -> None:
    """Every worker connected to the store, or TensorParallelError naming the first that died or raised first."""
    limit = start_timeout().total_seconds()
    deadline = time.monotonic() + limit
    waiting = dict(enumerate(procs, start=1))
    while waiting:
        for rank, proc in list(waiting.items()):
            if store.check([f"{ERROR_KEY}{rank}"]):
                text = bytes(store.get(f"{ERROR_KEY}{rank}")).decode("utf-8", "replace")
                raise TensorParallelError(f"tensor-parallel rank {rank} raised {text}")
            if store.check([f"{_JOINED}{rank}"]):
                del waiting[rank]
            elif not proc.is_alive():
                raise TensorParallelError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with status "
                                          f"{proc.exitcode} before joining")
        if time.monotonic() > deadline:
            raise TensorParallelError(f"tensor-parallel ranks {sorted(waiting)} did not join within "
                                      f"{limit:g} s")
        time.sleep(0.02)


def spawned_worker(spec: RunnerSpec, rank: int, folder: str, parent: int) -> None:
    """The entry of a spawned worker process: join rank 0's store, serve, exit."""
    watch_parent(parent, folder)  # rank 0 killed: nobody else removes the store's folder
    torch.set_num_threads(spec.threads)
    store = open_store(Path(folder))
    try:
        store.set(f"{_JOINED}{rank}", "1")
        group = Group(store, rank, spec.tensor_parallel_size, _device(spec, rank))
    except BaseException as e:
        _report(store, rank, e)
        os._exit(1)
    os._exit(serve(group, spec))


def _report(store: Any, rank: int, error: BaseException) -> None:
    with contextlib.suppress(RuntimeError):  # rank 0 is gone: nobody to tell
        store.set(f"{ERROR_KEY}{rank}", f"{type(error).__name__}: {error}")


def serve(group: Group, spec: RunnerSpec) -> int:
    """A worker: build this rank's runner and run rank 0's steps until told to stop; the exit status. An exception
    is left in the store for rank 0 (TP-9) and ends the worker."""
    try:
        runner = build_runner(spec, group)
        while (step := receive_step(group)) is not None:
            runner.forward(step)
    except BaseException as e:
        if not isinstance(e, TensorParallelError):
            _report(group.store, group.rank, e)
            group.end(f"tensor-parallel rank {group.rank} raised {type(e).__name__}: {e}")  # rank 0 hears at once
        return 1
    return 0


# torchrun -------------------------------------------------------------------------------------------------------


def _join_torchrun(spec: RunnerSpec, rank: int) -> Group:
    """Join the group torchrun set up (``env://``); a worker rank also watches its parent (torchrun's agent)."""
    if rank != 0:
        watch_parent(os.getppid())
        torch.set_num_threads(spec.threads)
    store, rank, size = next(rendezvous("env://", timeout=start_timeout()))
    return Group(store, rank, size, _device(spec, rank), loopback=False)
