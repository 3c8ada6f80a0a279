"""One tensor-parallel process group: the collectives a step needs, and what rank 0 says when one fails.

Invariant: every collective either completes on every rank or raises ``TensorParallelError`` on rank 0 within
the collective timeout (TP-9), naming the rank at fault when it can be known: a worker that raised left its
exception text in the rendezvous store before exiting, a worker that died left an exit code (spawned workers),
rank 0 itself raised in a step, a rank did not load its shard within the start timeout. After a failure the group
is dead: every later call raises the same error at once, the failing rank's side of the process groups is freed
(gloo closes its connections, so a peer's collective fails at once) and the workers rank 0 spawned are killed, so
no process outlives the failure.

The timeouts are read from the environment when a group is made (``NANOVERIFY_TP_TIMEOUT``,
``NANOVERIFY_TP_START_TIMEOUT``), never at import. A spawned group's store is a file in a private folder.

Two torch process groups over one store: ``compute`` (a step's payload, all-reduces and the logits gather; a
short timeout) and ``control`` (the step header a worker waits on between steps, however long the engine stays
idle; a long timeout). Both are made directly from the store rather than through ``init_process_group``, so one
process may hold several engines' groups at once (tests do).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore

from optimized.engine.model_runner import CollectiveError, StepMessage
from optimized.models.sharding import Shard, fixed_order_sum
from optimized.parallel.step import send_step

TIMEOUT_VARIABLE = "NANOVERIFY_TP_TIMEOUT"  # seconds a collective may take (default 60)
START_TIMEOUT_VARIABLE = "NANOVERIFY_TP_START_TIMEOUT"  # seconds every rank may take to load its shard (default 600)
IDLE_TIMEOUT = timedelta(days=30)  # a worker waiting for rank 0's next step
ERROR_KEY = "nanoverify/error/"  # + rank: a worker's exception text
FAILED_KEY = "nanoverify/failed/"  # + rank: why that rank's group ended (its whole message)


class TensorParallelError(CollectiveError):
    """A rank failed (died, raised or timed out); the message names it when known."""


def _seconds(variable: str, default: float) -> timedelta:
    """The timeout the environment ``variable`` sets, read now: a finite positive number of seconds, else a
    ValueError naming the variable."""
    text = os.environ.get(variable)
    if text is None:
        return timedelta(seconds=default)
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0 or seconds > _MAX_SECONDS:
        raise ValueError(f"{variable} must be a finite positive number of seconds (at most {_MAX_SECONDS:.0f}), "
                         f"got {text!r}")
    return timedelta(seconds=seconds)


_MAX_SECONDS = 30 * 86400.0


def collective_timeout() -> timedelta:
    """How long one collective may take (``NANOVERIFY_TP_TIMEOUT``, default 60 s)."""
    return _seconds(TIMEOUT_VARIABLE, 60.0)


def start_timeout() -> timedelta:
    """How long every rank may take to start and load its shard (``NANOVERIFY_TP_START_TIMEOUT``, default 600 s)."""
    return _seconds(START_TIMEOUT_VARIABLE, 600.0)


def private_store() -> tuple[Any, Path]:
    """A rendezvous store only this user can reach: a file in a fresh folder of mode 0700 (``tempfile.mkdtemp``),
    no listening socket (TP-2). The caller removes the folder when the group ends."""
    folder = Path(tempfile.mkdtemp(prefix="nanoverify-tp-"))
    return open_store(folder), folder


def open_store(folder: Path) -> Any:
    """The store in ``folder`` (a worker opens rank 0's)."""
    # -1: no count of users (the folder is removed as a whole). FileStore is public, but torch does not re-export it.
    store = dist.FileStore(str(folder / "store"), -1)  # type: ignore[attr-defined]
    store.set_timeout(collective_timeout())
    return store


@dataclass
class CommStats:
    """What this rank's collectives moved and how long it waited in them (wall seconds, skew included)."""

    all_reduces: int = 0
    all_reduce_bytes: int = 0
    all_reduce_seconds: float = 0.0
    gathers: int = 0
    gather_bytes: int = 0


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
        store_folder: Path | None = None,
    ) -> None:
        """``loopback``: every rank runs on this machine (spawned); torchrun's ranks may not. ``store_folder``:
        the private store's folder, removed once the workers are gone (rank 0 of a spawned group)."""
        self.shard = Shard(rank, size)
        self.store = store
        self.store_folder = store_folder
        self.device = device
        self.workers = list(workers)  # rank i + 1 is workers[i]
        self.failure: str | None = None
        self.threads_before: int | None = None  # rank 0: the caller's torch thread count, restored on close
        self.stats = CommStats()
        timeout = collective_timeout()
        self.compute: Any = _process_group(PrefixStore("compute/", store), rank, size, device, timeout, loopback)
        self.control: Any = _process_group(PrefixStore("control/", store), rank, size, device, IDLE_TIMEOUT, loopback)

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

    def all_reduce_in_rank_order(self, t: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of every rank's ``t`` on every rank, added in one fixed order (TP-11): every rank's
        ``t`` gathered, then ``fixed_order_sum`` over them in rank order, so an element's bits depend on the ranks'
        values alone, never on ``t``'s size or the transport's algorithm (gloo's all-reduce over 3 or more ranks
        adds in an order that depends on the size). A new tensor; counted as an all-reduce."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        seconds = self._wait(lambda: self.compute.allgather([parts], [t]))
        self.stats.all_reduces += 1
        self.stats.all_reduce_bytes += t.numel() * t.element_size()
        self.stats.all_reduce_seconds += seconds
        return fixed_order_sum(parts)

    def gather_columns(self, t: torch.Tensor) -> torch.Tensor:
        opts = dist.GatherOptions()
        opts.rootRank = 0
        t = t.contiguous()
        self.stats.gathers += 1
        self.stats.gather_bytes += t.numel() * t.element_size()
        if self.rank != 0:
            self._wait(lambda: self.compute.gather([], [t], opts))
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._wait(lambda: self.compute.gather([parts], [t], opts))
        return torch.cat(parts, dim=-1)

    def broadcast(self, t: torch.Tensor, idle: bool = False) -> torch.Tensor:
        """``t`` of rank 0 on every rank; ``idle``: over the control group (a worker waiting for a step)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        group = self.control if idle else self.compute
        self._wait(lambda: group.broadcast([t], opts))
        return t

    def send_step(self, step: StepMessage) -> None:
        """Rank 0: ``step`` to every worker (the runner's ``StepBroadcast``; the wire is parallel/step.py's)."""
        send_step(self, step)

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
        return self.end(self._diagnose(cause)) if self.failure is None else TensorParallelError(self.failure)

    def fail_here(self, cause: BaseException) -> TensorParallelError:
        """This rank raised outside a collective (rank 0's forward, after the step went out, TP-9): the group is
        dead, its peers are stopped at once, and the error names this rank."""
        if self.failure is not None:
            return TensorParallelError(self.failure)
        return self.end(f"tensor-parallel rank {self.rank} raised {type(cause).__name__}: {cause}")

    def end(self, failure: str) -> TensorParallelError:
        """Mark the group dead with ``failure`` and return its error: the peers are told (the store), this rank's
        side of the collectives is aborted (a peer waiting in one fails at once), the spawned workers killed."""
        self.failure = failure
        with contextlib.suppress(RuntimeError):  # the store may be gone with its host
            self.store.set(f"{FAILED_KEY}{self.rank}", failure)
        if self.device.type == "cuda":
            for group in (self.compute, self.control):
                with contextlib.suppress(RuntimeError):
                    group.abort()
        # The spawned workers are killed first, so none leaves by itself on seeing the group freed (one exit path);
        # freed, a gloo group closes its connections: a torchrun peer waiting in a collective fails at once.
        self.kill_workers()
        self.compute = self.control = None
        return TensorParallelError(failure)

    def wait_for_ranks(self, stage: str, timeout: timedelta) -> None:
        """Every rank got to ``stage`` (e.g. "load its shard") within ``timeout``, or TensorParallelError naming
        the rank that raised, died, or did not get there in time (TP-9): a store poll, not a collective, so a slow
        rank is named rather than blamed on a collective's timeout."""
        self.check_alive()
        self.store.set(f"nanoverify/{stage}/{self.rank}", "1")
        waiting = set(range(self.size)) - {self.rank}
        deadline = time.monotonic() + timeout.total_seconds()
        while waiting:
            for rank in sorted(waiting):
                fault = self._fault_of(rank)
                if fault is not None:
                    raise self.end(fault)
                if self.store.check([f"nanoverify/{stage}/{rank}"]):
                    waiting.discard(rank)
            if waiting and time.monotonic() > deadline:
                raise self.end(f"tensor-parallel rank {min(waiting)} did not {stage} within "
                               f"{timeout.total_seconds():g} s ({START_TIMEOUT_VARIABLE})")
            time.sleep(0.02)

    def _fault_of(self, rank: int) -> str | None:
        """Why ``rank`` cannot go on, when it said so (an exception, an ended group) or died; else None."""
        text = self._error_of(rank)
        if text is not None:
            return f"tensor-parallel rank {rank} raised {text}"
        ended = self._error_of(rank, FAILED_KEY)
        if ended is not None:
            return ended
        if 1 <= rank <= len(self.workers) and self.workers[rank - 1].exitcode not in (None, 0):
            proc = self.workers[rank - 1]
            return f"tensor-parallel rank {rank} (pid {proc.pid}) {_exit_text(proc.exitcode)}"
        return None

    def _diagnose(self, cause: BaseException) -> str:
        deadline = time.monotonic() + 2.0  # a worker that closed its sockets is reaped within moments
        while True:
            for rank in range(self.size):
                fault = None if rank == self.rank else self._fault_of(rank)
                if fault is not None:
                    return fault
            if time.monotonic() > deadline:
                first = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
                return f"a tensor-parallel collective failed on rank {self.rank} ({first})"
            time.sleep(0.05)

    def _error_of(self, rank: int, prefix: str = ERROR_KEY) -> str | None:
        key = f"{prefix}{rank}"
        try:
            if self.store.check([key]):
                return bytes(self.store.get(key)).decode("utf-8", "replace")
        except RuntimeError:
            pass
        return None

    def kill_workers(self) -> None:
        """Kill the spawned workers still running, then remove the private store's folder (nobody is left to
        read it)."""
        for proc in self.workers:
            if proc.is_alive():
                proc.kill()
        for proc in self.workers:
            proc.join(timeout=5)
        if self.store_folder is not None:
            shutil.rmtree(self.store_folder, ignore_errors=True)

    def join_workers(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the spawned workers to exit, then kill any left."""
        deadline = time.monotonic() + timeout
        for proc in self.workers:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill_workers()
