"""``LLM``: the user's entry point (vLLM conventions) over the engine.

Invariants: a bad constructor argument is a ValueError naming the field,
raised before anything is loaded; ``generate`` validates every request of the
call before adding any (ENG-10), so a refused call changes nothing; it returns
one ``RequestOutput`` per prompt, in prompt order. Unseeded requests get a seed
drawn at add time from the LLM's own generator (``seed``), so a whole run is
reproducible and no request shares another's draws. Beside ``generate`` the
step-level API (``add_request``, ``step``, ``has_unfinished_requests``,
``abort``; spec/abort.md, beyond the lesson) serves requests one step at a
time; ``generate`` is built on the same add and step. Every request added with
``add_request`` has its output returned exactly once, by ``step`` (or by
``abort``, with finish_reason "abort"); an output that finishes while
``generate`` drives the engine, or in a failed step, waits for the next
``step``. When a step raises, ``generate`` aborts its own live requests before
re-raising (FAULT-3), so the engine is reusable; the exception that reaches the
caller is always the original one (FAULT-5). Stop strings (``SamplingParams.stop``, spec/serve.md SERVE-5):
after each step a request that has them is fed its new tokens through an incremental detokenizer, and the
token that completes one ends it there, through the engine's abort with reason "stop" (so check mode mirrors
it); its text stops before the stop string.

Threads (THREAD-1, THREAD-2): an ``LLM`` may be called from several threads.
One lock serializes every call into the engine, and it is held for one engine
operation at a time: ``add_request``, ``abort``, ``step``,
``has_unfinished_requests``, the adding of one ``generate`` call's requests (all
at once), and each step ``generate`` runs. ``generate`` does not hold it for
its whole run: between its steps other threads add, abort and step, so several
``generate`` calls are batched together. A step run by any caller advances
every queued request; each ``generate`` waits until its own requests are
finished (whoever ran the step that finished them) and returns only those,
while ``add_request`` outputs are left for ``step``.
"""

from __future__ import annotations

import random
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optimized.engine.args import EngineArgs
from optimized.engine.detokenizer import IncrementalDetokenizer
from optimized.engine.engine import Engine, EngineStats, Request, describe
from optimized.engine.sampling_params import Logprob, SamplingParams
from optimized.engine.validation import EngineLimits, RequestRefused
from optimized.entry.build import build_engine
from optimized.entry.requests import validated_request
from optimized.trace.recorder import Recorder, TraceObserver, trace_file
from optimized.verify.shadow import Shadow

if TYPE_CHECKING:
    import torch

    from optimized.models.decoder import CausalLM
    from optimized.parallel.group import CommStats

@dataclass(frozen=True)
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (eos or a stop token), "length", "abort" (ABORT-8) or "error" (FAULT-1)
    # ENG-18: asked with SamplingParams.logprobs, one dict per generated token (token id -> Logprob: the top
    # alternatives by rank, then the drawn token if not among them); prompt_logprobs likewise per prompt token,
    # None for the first. None when not asked.
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass(frozen=True)
class Gauges:
    """The engine's load between steps (SERVE-7's gauges)."""

    running: int
    waiting: int
    free_blocks: int
    num_blocks: int


@dataclass(frozen=True)
class EngineState:
    """The scheduler between steps, and every state invariant checked on it (SERVE-7's verbose health)."""

    num_blocks: int
    free_blocks: int
    cached_blocks: int
    waiting: int
    running: int
    violations: list[str]
    compared_steps: int  # steps check mode compared with the reference


def _completion_since(request: Request, start: int) -> list[int]:
    """The tokens ``request`` has generated, from its ``start``-th on."""
    seq = request.seq
    return seq.stored_tokens()[seq.num_prompt_tokens + start :].tolist()  # type: ignore[no-any-return]


class _Bookkeeping:
    """``with``: one piece of this LLM's own bookkeeping around the engine (handing outputs over, recording ids).

    FAULT-6: it begins only on a trusted LLM (the caller holds the lock); an exception inside it leaves
    ``llm.interrupted`` set, since an output may be lost half-way, and the LLM then refuses further use; a model
    fault the engine recovered from clears it first (``LLM._engine_step``).
    """

    __slots__ = ("llm", "what")

    def __init__(self, llm: LLM, what: str) -> None:
        self.llm = llm
        self.what = what

    def __enter__(self) -> None:
        self.llm._require_trusted_locked()  # never over another caller's interruption, which would hide it
        self.llm.interrupted = self.what

    def __exit__(self, kind: object, error: BaseException | None, trace: object) -> None:
        if error is None:
            self.llm.interrupted = None
        elif self.llm.interrupted is not None:
            self.llm.interrupted_by = describe(error)


class LLM:
    # ARCH-5: all that serve/, cli/ and benchmarks/ may use of an LLM (tests/test_architecture.py holds them to it)
    REQUEST_API = ("generate", "add_request", "add_validated", "step", "has_unfinished_requests", "abort",
                   "completion_tokens", "completion_logprobs", "close")
    READ_API = ("limits", "stats", "checked", "traced", "trusted", "engine_state", "started", "gauges",
                "comm_stats", "reset_comm_stats", "settings", "enforce_eager", "model_dir", "device", "network",
                "decode_graphs")

    def __init__(self, model: str | Path | None = None, **kwargs: Any) -> None:
        """Load ``model`` (a checkpoint folder; None: the embedded default model) and size the KV cache.

        ``kwargs`` are ``EngineArgs``' fields (optimized/engine/args.py: each one's default, bounds and help); a
        name that is none of them is a ValueError naming it. ``num_kvcache_blocks`` defaults to what fits a memory
        budget: ``gpu_memory_utilization`` of the GPU (less what weights and activations take) or
        ``cpu_kvcache_gib`` GiB on the CPU. ``enforce_eager`` None means CUDA-graph decode on CUDA with a
        capturable backend, eager everywhere else (ENG-28). ``tensor_parallel_size`` N > 1 splits the model over
        N processes (spec/parallel.md): N - 1 spawned workers, or the ranks torchrun started (on a torchrun rank
        other than 0 this serves rank 0 and then exits the process). ``close()`` (or leaving a ``with`` block)
        stops them. ``trace``: a file the run is recorded in as it happens (spec/trace.md, TRACE-1), each step's
        wall times too when ``trace_wall_times``.
        """
        from optimized.parallel import launch

        args = EngineArgs.of(model=model, **kwargs)
        trace_path = trace_file(args.trace)
        parts = build_engine(args)
        if parts.group is not None:  # TP-3: an LLM dropped unclosed still stops its workers
            weakref.finalize(self, launch.close, parts.group)
        self._group = parts.group
        self.settings = parts.settings  # (read API) EngineArgs with every None resolved: dtype, device, backend...
        self.enforce_eager = bool(parts.settings.enforce_eager)
        self.model_dir = parts.model_dir
        self.tokenizer = parts.tokenizer
        config, limits = parts.config, parts.limits
        self.engine = Engine(parts.runner, config, limits)
        # The plug-ins, wired here and known to the engine only as observers (ARCH-3): the trace first, so a step
        # the shadow finds divergent is still on disk.
        self.recorder = None if trace_path is None else Recorder(trace_path, config, limits.eos_token_ids,
                                                                 args.trace_wall_times,
                                                                 max_model_len=limits.max_model_len)
        if self.recorder is not None:
            self.engine.observers.append(TraceObserver(self.recorder, limits.eos))
        self.shadow = Shadow(config, self.engine.stats, args.check_full_every) if args.check else None
        if self.shadow is not None:
            self.engine.observers.append(self.shadow)
        self._rng = random.Random(args.seed)
        self._lock = threading.Lock()  # THREAD-1: held for one engine operation at a time
        self._changes = 0  # steps and aborts so far: a generate call that sees it move rescans its requests
        self.interrupted: str | None = None  # FAULT-6: the bookkeeping an exception broke off, if any
        self.interrupted_by = ""
        self._stepped: dict[int, str | None] = {}  # add_request ids whose output is not returned yet: their prompt
        self._undelivered: list[RequestOutput] = []  # their outputs that finished outside step()
        self._watched: dict[int, IncrementalDetokenizer] = {}  # live requests with stop strings (SERVE-5)
        self._stop_text: dict[int, str] = {}  # finished ones' text, cut before the stop string

    # --- the read API: what serve/, cli/ and benchmarks/ may know of the engine (ARCH-5) ---------------------
    @property
    def limits(self) -> EngineLimits:
        """The engine's fixed limits: vocabulary, max_model_len, KV blocks and their size, EOS ids."""
        return self.engine.limits

    @property
    def stats(self) -> EngineStats:
        """The engine's counters since it was made (steps, tokens, preemptions, cache hits, seconds)."""
        return self.engine.stats

    @property
    def checked(self) -> bool:
        """Check mode is on: every step is compared with the reference scheduler."""
        return self.shadow is not None

    @property
    def traced(self) -> bool:
        """A trace records the run (TRACE-1)."""
        return self.recorder is not None

    @property
    def trusted(self) -> bool:
        """The LLM may still be used: no exception left the engine's state undefined (ENG-11) nor broke off
        this LLM's bookkeeping (FAULT-6)."""
        return self.engine.trusted and self.interrupted is None

    def engine_state(self) -> EngineState:
        """SERVE-7: the scheduler's block accounting and queues, and the violations of every state invariant
        (invariants.md) on it; read under the lock, so between steps."""
        from invariants import check_state, snapshot

        with self._lock:
            state = snapshot(self.engine.scheduler)
            return EngineState(state.num_blocks, len(state.free_block_ids), len(state.hash_to_block_id),
                               len(state.waiting), len(state.running), [str(v) for v in check_state(state)],
                               self.engine.stats.compared_steps)

    def started(self, request_id: int) -> bool:
        """SERVE-13: a step has begun computing the request (it holds blocks), or it is no longer live."""
        with self._lock:
            request = self.engine.by_arrival.get(request_id)
            return request is None or bool(request.seq.block_table)

    def gauges(self) -> Gauges:
        """Requests running and waiting, and KV blocks free, between steps (no lock: one consistent read of
        three counters is not promised while another thread steps)."""
        scheduler = self.engine.scheduler
        return Gauges(len(scheduler.running), len(scheduler.waiting), scheduler.block_manager.free.count,
                      self.engine.limits.num_blocks)

    def comm_stats(self) -> CommStats | None:
        """Rank 0's tensor-parallel communication since the last reset (TP-10); None without tensor parallelism."""
        return None if self._group is None else self._group.stats

    def reset_comm_stats(self) -> None:
        """Start rank 0's communication counters afresh (a benchmark's timed run only)."""
        if self._group is not None:
            from optimized.parallel.group import CommStats

            self._group.stats = CommStats()

    @property
    def device(self) -> torch.device:
        """The device the model runs on (rank 0's under tensor parallelism)."""
        return self.engine.runner.device

    def network(self) -> CausalLM:
        """The loaded model (rank 0's piece under tensor parallelism), for the GPU benchmarks that weigh it."""
        return self.engine.runner.model

    def decode_graphs(self) -> tuple[int, int]:
        """The decode steps served by graphs so far, and the graphs captured (0, 0 when eager: ENG-28)."""
        graphs = self.engine.runner.graphs
        return (0, 0) if graphs is None else (self.engine.runner.graph_steps, len(graphs.graphs))

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any, and wait for them (TP-3); the LLM is unusable afterwards
        under tensor parallelism. Idempotent; a single-process LLM has nothing to stop. A trace is flushed and
        closed (TRACE-1)."""
        from optimized.parallel import launch

        with self._lock:
            try:
                launch.close(self._group)
            finally:  # the trace is closed even when stopping the workers raised
                shadow = self.shadow
                for observer in self.engine.observers:
                    if shadow is not None and observer is shadow:  # CHECK-3: no state a change left half done
                        shadow.close(trusted=self.engine.trusted)
                    else:
                        observer.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        self.close()

    def _validated(self, prompt: str | list[int], params: SamplingParams,
                   priority: object = 0) -> tuple[list[int], SamplingParams, int]:
        """ENG-10, ARCH-6: the prompt's token ids, its params and its priority (POLICY-12), or a RequestRefused
        (nothing changed); every observer is asked last (TRACE-4: the trace's add record)."""
        return validated_request(prompt, params, self.engine.limits, self.tokenizer, self._ask_observers, priority)

    def _ask_observers(self, ids: list[int], params: SamplingParams) -> None:
        for observer in self.engine.observers:
            observer.check_add(ids, params)

    def _add(self, ids: list[int], params: SamplingParams, priority: int) -> Request:
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        request = self.engine.add_validated(ids, params, seed, priority)
        if params.stop:
            self._watched[request.arrival] = IncrementalDetokenizer(self.tokenizer, params.stop)
        return request

    def completion_tokens(self, request_id: int, start: int = 0) -> list[int] | None:
        """SERVE-3: the tokens a live request has generated so far, from ``start``; None once it has finished
        (its output carries them all). Between steps only: the caller holds no step in progress."""
        with self._lock:
            request = self.engine.by_arrival.get(request_id)
            if request is None:
                return None
            return _completion_since(request, start)

    def completion_logprobs(self, request_id: int, start: int = 0) -> list[dict[int, Logprob]] | None:
        """SERVE-3, ENG-18: a live request's generated tokens' logprobs so far, from ``start``; None once it has
        finished or when it did not ask. Between steps only."""
        with self._lock:
            request = self.engine.by_arrival.get(request_id)
            if request is None or request.logprobs is None:
                return None
            return request.logprobs[start:]

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    priority: int = 0) -> int:
        """ABORT-7: validate and queue one request (as generate would); its request_id. ``priority``: lower
        first under the ``priority`` policy, and refused other than 0 under every other (POLICY-12). Refused:
        RequestRefused (ARCH-6)."""
        self._require_trusted()
        ids, params, checked = self._validated(prompt, SamplingParams() if sampling_params is None
                                               else sampling_params, priority)
        with self._lock, _Bookkeeping(self, "an add_request"):
            request = self._add(ids, params, checked)
            self._stepped[request.arrival] = prompt if isinstance(prompt, str) else None
        return request.arrival

    def add_validated(self, prompt_ids: list[int], sampling_params: SamplingParams, priority: int = 0) -> int:
        """``add_request`` for a caller that ran the one validator (``entry.requests.validated_request``) with this
        LLM's limits and ``trace_check(self.traced)``, as the server's HTTP side does: only trust and the trace's
        writability are checked again (ENG-11, TRACE-1). Its request_id; its output has no prompt text."""
        with self._lock, _Bookkeeping(self, "an add_request"):
            request = self._add(prompt_ids, sampling_params, priority)
            self._stepped[request.arrival] = None
        return request.arrival

    def _require_trusted(self) -> None:
        """ENG-11, FAULT-6, first of all; read under the lock, since another thread's step makes the engine busy."""
        with self._lock:
            self._require_trusted_locked()

    def _require_trusted_locked(self) -> None:
        self.engine.require_trusted()
        if self.interrupted is not None:
            raise RuntimeError(f"the LLM was interrupted during {self.interrupted} ({self.interrupted_by}) and may "
                               "have lost outputs: make a new LLM")

    def has_unfinished_requests(self) -> bool:
        """ABORT-7: a request is queued, or an add_request output is still to be returned by step()."""
        with self._lock:
            return bool(self._undelivered) or self.engine.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """ABORT-7: one scheduler step (none when only outputs are pending); the add_request outputs finished.

        FAULT-1: if the model raises, the exception propagates; the failed batch's requests finish with
        finish_reason "error" and the next step() returns their outputs.
        """
        # The bookkeeping refuses an untrusted LLM (ENG-11), even when there is nothing to step.
        with self._lock, _Bookkeeping(self, "a step"):
            finished = self._engine_step() if self.engine.has_unfinished() else []
            # Taken only now: if the step raised, what was pending is still pending.
            outputs, self._undelivered = self._undelivered, []
            return outputs + self._deliver(finished)

    def abort(self, request_id: int) -> RequestOutput | None:
        """ABORT-8: abort a live request; its output (finish_reason "abort"), never returned by step() then.

        An id never issued is a ValueError; a request already finished is left alone and None returned.
        """
        with self._lock:
            self._require_trusted_locked()
            self.engine.check_issued(request_id)  # a bad id changes nothing (before the bookkeeping begins)
            with _Bookkeeping(self, "an abort"):
                request = self.engine.abort(request_id)
                self._changes += 1
                if request is None:
                    return None
                prompt = self._stepped.pop(request.arrival, None)
                return self._output(request, prompt)

    def _engine_step(self) -> list[Request]:
        """engine.step(); on a fault, the failed add_request outputs are kept for the next step() (FAULT-1)."""
        self._changes += 1
        try:
            finished = self.engine.step()
        except BaseException:
            self._undelivered += self._deliver(self.engine.take_failed())
            if self.engine.trusted:  # FAULT-1: the engine recovered and the failed outputs are kept
                self.interrupted = None
            raise
        return finished + self._end_at_stop_strings(finished) if self._watched else finished

    def _end_at_stop_strings(self, finished: list[Request]) -> list[Request]:
        """SERVE-5: feed each watched request its new tokens; one whose text now holds a stop string ends here:
        finished this step already, its reason becomes "stop"; still live, it is aborted (as ABORT-8, mirrored
        by check mode) with reason "stop". The requests ended so; the finished ones' text is kept cut."""
        ended = {r.arrival: r for r in finished}
        stopped = []
        for arrival, watch in list(self._watched.items()):
            request = ended.get(arrival) or self.engine.by_arrival.get(arrival)
            if request is None:  # aborted or failed meanwhile
                del self._watched[arrival]
                continue
            hit = watch.add(_completion_since(request, watch.num_tokens))
            if hit and arrival not in ended:
                self.engine.abort(arrival, reason="stop")
                stopped.append(request)
            if hit or arrival in ended:
                del self._watched[arrival]
                self._stop_text[arrival] = watch.finish()
                if watch.stopped:
                    request.finish_reason = "stop"
        return stopped

    def _deliver(self, finished: list[Request]) -> list[RequestOutput]:
        """The outputs of the add_request requests among ``finished``; they are returned now, never again."""
        return [self._output(r, self._stepped.pop(r.arrival)) for r in finished if r.arrival in self._stepped]

    def generate(
        self,
        prompts: Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; one output per prompt, in order. Refuses the whole call on one bad request.

        ``priority``: one per prompt (vLLM's), lower first under the ``priority`` policy; None: every one 0, the
        only value another policy takes (POLICY-12).

        FAULT-3: when a step raises, this call's live requests are aborted before the exception propagates.
        THREAD-2: other threads may use the LLM meanwhile; the outputs returned are this call's only.
        """
        self._require_trusted()
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a list of strings or of token-id lists, got {type(prompts).__name__}")
        params = self._params_per_prompt(sampling_params, len(prompts))
        priorities = self._priority_per_prompt(priority, len(prompts))
        validated = []
        for i, sp in enumerate(params):
            try:
                validated.append(self._validated(prompts[i], sp, priorities[i]))
            except RequestRefused as e:
                raise RequestRefused(e.field, e.reason, e.code, f"prompt {i}: {e}") from None
        requests: list[Request] = []
        try:
            with self._lock, _Bookkeeping(self, "a generate call's adds"):
                for ids, sp, rank in validated:
                    requests.append(self._add(ids, sp, rank))
            self._run(requests, use_tqdm)
        except BaseException as error:
            self._abort_after(error, requests)
            raise
        return [self._output(r, p if isinstance(p, str) else None) for r, p in zip(requests, prompts, strict=True)]

    @staticmethod
    def _params_per_prompt(sampling_params: object, count: int) -> list[SamplingParams]:
        """ENG-10: one SamplingParams for each prompt; None (the whole argument only) means the defaults."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if not isinstance(sampling_params, (list, tuple)):
            raise RequestRefused("sampling_params", "must be a SamplingParams or a list of them, "
                                 f"got {type(sampling_params).__name__}")
        for i, sp in enumerate(sampling_params):
            if not isinstance(sp, SamplingParams):
                got = f"must be a SamplingParams, got {type(sp).__name__}"
                raise RequestRefused("sampling_params", f"element {i} {got}", None, f"sampling_params[{i}] {got}")
        if len(sampling_params) != count:
            n = len(sampling_params)
            raise RequestRefused("sampling_params", f"holds {n} for {count} prompts", None,
                                 f"sampling_params: {n} given for {count} prompts")
        return list(sampling_params)

    @staticmethod
    def _priority_per_prompt(priority: object, count: int) -> list[object]:
        """POLICY-12: one priority for each prompt (each checked by the one validator); None means 0 for all."""
        if priority is None:
            return [0] * count
        if not isinstance(priority, (list, tuple)):
            raise RequestRefused("priority", f"must be a list of ints, one per prompt, got {type(priority).__name__}")
        if len(priority) != count:
            raise RequestRefused("priority", f"holds {len(priority)} for {count} prompts", None,
                                 f"priority: {len(priority)} given for {count} prompts")
        return list(priority)

    def _abort_after(self, error: BaseException, requests: list[Request]) -> None:
        """FAULT-3: abort this call's live requests when the engine is still trusted (a model fault, or an
        exception between steps). FAULT-5: if that raises too, note it on ``error``, which the caller re-raises."""
        try:
            with self._lock:
                if self.engine.trusted:
                    for r in requests:
                        self.engine.abort(r.arrival)  # None for those already finished
        except BaseException as second:
            error.add_note(f"aborting this call's requests then raised {describe(second)}")

    def _run(self, requests: list[Request], use_tqdm: bool) -> None:
        """Step until every one of ``requests`` is finished, by this thread's steps or another's (THREAD-2)."""
        from tqdm import tqdm

        st = self.engine.stats
        pending = {r.arrival: r for r in requests}
        seen = -1  # the value of _changes after this call's last step: scan ``pending`` first
        with tqdm(total=len(requests), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while pending:
                with self._lock:
                    if self._changes != seen:  # another caller stepped or aborted: it may have finished ours
                        for arrival in [a for a, r in pending.items() if r.finish_reason is not None]:
                            del pending[arrival]
                    if pending:
                        with _Bookkeeping(self, "a step"):
                            finished = self._engine_step()
                            self._undelivered += self._deliver(finished)
                            for r in finished:
                                pending.pop(r.arrival, None)
                    seen = self._changes
                bar.update(len(requests) - len(pending) - bar.n)
                prefill = st.prefill_tokens / st.prefill_seconds if st.prefill_seconds else 0.0
                decode = st.decode_tokens / st.decode_seconds if st.decode_seconds else 0.0
                bar.set_postfix_str(f"prefill {prefill:.0f} tok/s, decode {decode:.0f} tok/s", refresh=False)

    def _output(self, r: Request, prompt: str | None) -> RequestOutput:
        assert r.finish_reason is not None
        completion = r.seq.completion_token_ids
        return RequestOutput(
            request_id=r.arrival,
            prompt=prompt,
            prompt_token_ids=r.seq.token_ids[: r.seq.num_prompt_tokens],
            token_ids=completion,
            text=self._stop_text.pop(r.arrival) if r.arrival in self._stop_text else self.tokenizer.decode(completion),
            finish_reason=r.finish_reason,
            logprobs=None if r.logprobs is None else list(r.logprobs),
            prompt_logprobs=None if r.prompt_logprobs is None else list(r.prompt_logprobs),
        )
