"""One tensor-parallel process group: the collectives a step needs, and what rank 0 says when one fails.

Invariant: every collective either completes on every rank or raises ``TensorParallelError`` on rank 0 within
``COLLECTIVE_TIMEOUT`` (TP-8), naming the rank at fault when it can be known: a worker that raised left its
exception text in the rendezvous store before exiting, a worker that died left an exit code (spawned workers).
After a failure the group is dead: every later call raises the same error at once, and the workers rank 0 spawned
are killed, so no process outlives the failure.

Two torch process groups over one store: ``compute`` (a step's payload, all-reduces and the logits gather; a
short timeout) and ``control`` (the step header a worker waits on between steps, however long the engine stays
idle; a long timeout). Both are made directly from the store rather than through ``init_process_group``, so one
process may hold several engines' groups at once (tests do).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore

from optimized.parallel.sharding import Shard

COLLECTIVE_TIMEOUT = timedelta(seconds=float(os.environ.get("NANOVERIFY_TP_TIMEOUT", "60")))
IDLE_TIMEOUT = timedelta(days=30)  # a worker waiting for rank 0's next step
ERROR_KEY = "nanoverify/error/"  # + rank: a worker's exception text


class TensorParallelError(RuntimeError):
    """A rank failed (died, raised or timed out); the message names it when known."""


@dataclass
class CommStats:
    """What this rank's collectives moved and how long it waited in them (wall seconds, skew included)."""

    all_reduces: int = 0
    all_reduce_bytes: int = 0
    all_reduce_seconds: float = 0.0
    gathers: int = 0
    gather_bytes: int = 0
    gather_seconds: float = 0.0
    broadcasts: int = 0
    broadcast_bytes: int = 0
    broadcast_seconds: float = 0.0


def _process_group(
    store: Any, rank: int, size: int, device: torch.device, timeout: timedelta, loopback: bool
) -> Any:
    """NCCL on CUDA, else gloo; ``loopback``: every rank on this machine, so gloo talks over 127.0.0.1 (no
    hostname to resolve)."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    if not loopback:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    gloo_class: Any = dist.ProcessGroupGloo  # its _Options (devices and timeout) is missing from torch's stubs
    options = gloo_class._Options()
    options._devices = [gloo_class.create_device(hostname="127.0.0.1")]
    options._timeout = timeout
    return gloo_class(store, rank, size, options)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "stopped responding"
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


class Group:
    """Rank ``rank`` of ``size`` over ``store``; rank 0 also holds the worker processes it spawned."""

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        device: torch.device,
        workers: Sequence[BaseProcess] = (),
        loopback: bool = True,
    ) -> None:
        """``loopback``: every rank runs on this machine (spawned); torchrun's ranks may not."""
        self.shard = Shard(rank, size)
        self.store = store
        self.device = device
        self.workers = list(workers)  # rank i + 1 is workers[i]
        self.failure: str | None = None
        self.stats = CommStats()
        self.compute = _process_group(PrefixStore("compute/", store), rank, size, device, COLLECTIVE_TIMEOUT, loopback)
        self.control = _process_group(PrefixStore("control/", store), rank, size, device, IDLE_TIMEOUT, loopback)

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    # Collectives -----------------------------------------------------------------------------------------------

    def _wait(self, issue: Callable[[], Any]) -> float:
        """Issue a collective and wait for it; the seconds it took (a failure raises TensorParallelError)."""
        self.check_alive()
        start = time.perf_counter()
        try:
            issue().wait()
        except RuntimeError as e:
            raise self.fail(e) from None
        return time.perf_counter() - start

    def all_reduce(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM if op is None else op)
        seconds = self._wait(lambda: self.compute.allreduce([t], opts))
        self.stats.all_reduces += 1
        self.stats.all_reduce_bytes += t.numel() * t.element_size()
        self.stats.all_reduce_seconds += seconds
        return t

    def gather_columns(self, t: torch.Tensor) -> torch.Tensor:
        opts = dist.GatherOptions()
        opts.rootRank = 0
        t = t.contiguous()
        self.stats.gathers += 1
        self.stats.gather_bytes += t.numel() * t.element_size()
        if self.rank != 0:
            self.stats.gather_seconds += self._wait(lambda: self.compute.gather([], [t], opts))
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self.stats.gather_seconds += self._wait(lambda: self.compute.gather([parts], [t], opts))
        return torch.cat(parts, dim=-1)

    def broadcast(self, t: torch.Tensor, idle: bool = False) -> torch.Tensor:
        """``t`` of rank 0 on every rank; ``idle``: over the control group (a worker waiting for a step)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        group = self.control if idle else self.compute
        seconds = self._wait(lambda: group.broadcast([t], opts))
        if not idle or self.rank == 0:  # a worker's wait for the next step is idle time, not communication
            self.stats.broadcasts += 1
            self.stats.broadcast_bytes += t.numel() * t.element_size()
            self.stats.broadcast_seconds += seconds
        return t

    def agree_min(self, value: int) -> int:
        """The least of every rank's ``value`` (e.g. the KV blocks each rank's memory holds), on every rank."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        return int(self.all_reduce(t, dist.ReduceOp.MIN).item())

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (each the same length), in rank order."""
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._wait(lambda: self.compute.allgather([parts], [t]))
        return [bytes(p.cpu().tolist()) for p in parts]

    # Faults ----------------------------------------------------------------------------------------------------

    def check_alive(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    def fail(self, cause: BaseException) -> TensorParallelError:
        """The group is dead: the error naming the rank at fault (when known); the spawned workers are killed."""
        if self.failure is None:
            self.failure = self._diagnose(cause)
            self.kill_workers()
        return TensorParallelError(self.failure)

    def _diagnose(self, cause: BaseException) -> str:
        deadline = time.monotonic() + 2.0  # a worker that closed its sockets is reaped within moments
        while True:
            for rank in range(1, self.size):
                text = self._error_of(rank)
                if text is not None:
                    return f"tensor-parallel rank {rank} raised {text}"
            for rank, proc in enumerate(self.workers, start=1):
                if proc.exitcode is not None and proc.exitcode != 0:
                    return f"tensor-parallel rank {rank} (pid {proc.pid}) {_exit_text(proc.exitcode)}"
            if time.monotonic() > deadline:
                first = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
                return f"a tensor-parallel collective failed on rank {self.rank} ({first})"
            time.sleep(0.05)

    def _error_of(self, rank: int) -> str | None:
        key = f"{ERROR_KEY}{rank}"
        try:
            if self.store.check([key]):
                return bytes(self.store.get(key)).decode("utf-8", "replace")
        except RuntimeError:
            pass
        return None

    def kill_workers(self) -> None:
        for proc in self.workers:
            if proc.is_alive():
                proc.kill()
        for proc in self.workers:
            proc.join(timeout=5)

    def join_workers(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the spawned workers to exit, then kill any left."""
        deadline = time.monotonic() + timeout
        for proc in self.workers:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill_workers()
