"""One scheduled batch in, one token per sequence out: inputs, forward, sampling.

The runner owns the paged KV cache, one k and one v tensor per layer of shape
[num_blocks, block_size, kv_heads, head_dim] (views of one allocation). It
computes only the tokens the scheduler granted: positions
[num_cached_tokens, num_cached_tokens + num_scheduled_tokens) of each
sequence, so prefix-cache hits and earlier chunks are read from the cache,
never recomputed, and a preempted sequence (whose blocks were freed) is simply
prefilled again. Inputs are built with numpy array operations, one Python
iteration per sequence and none per token. Logits are computed, and a token
drawn, only for sequences whose prompt is complete after this step; the others
get ``PLACEHOLDER``, which the scheduler discards. Every row's token is a pure
function of its own logits and draw parameters, so the runner may order rows as
it likes. What a decode step does follows the backend's declared capabilities,
never its name: a backend that does not read the cache in place (it gathers the
blocks of its table width, as torch does) gets the rows sorted by context length,
a backend that reads it in place gets the whole batch in the scheduler's order
(ENG-26); a backend that needs a decode plan is asked for one once per eager
decode step and gets it back in every layer (ENG-30); greedy rows never touch
the random draw (ENG-27). With ``enforce_eager=False`` a decode step of at most
``max_num_seqs`` sequences runs through ``GraphRunner``'s bucketed static
buffers instead (ENG-28): a CUDA graph on CUDA, which needs a ``capturable``
backend, the eager stand-in on the CPU. Under tensor parallelism (spec/parallel.md) rank 0's runner sends each
step's inputs to the workers, whose runners call ``forward`` with them; only rank 0 samples (TP-6, TP-7).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from invariants.block_math import batch_slot_mapping, blocks_for
from kernels.backend import AttentionBackend
from kernels.rotary import rotary_cos_sin
from kernels.sampling import sample
from optimized.engine.graph_runner import DecodeMetadata, GraphFactory, GraphRunner, cuda_graph_factory
from optimized.engine.logprobs import PromptSeq, SeqLogprobs, asked, prompt_plan, step_logprobs
from optimized.models.decoder import AttentionContext, CausalLM, TensorParallel

PLACEHOLDER = -1  # the token handed to postprocess for an unfinished prefill chunk
# On the CPU a step of more tokens than this runs its row-wise work (norms, projections, rotary, MLP) in slices of
# this many rows, whose intermediates stay in cache (measured: the MLP of an 8094-token prefill, 111 ms whole,
# 96 ms in slices of 256 rows). MKL's products of a row differ in the last bits with the slice's row count; the
# batch-invariant mode's do not (BI-9).
CPU_ROW_CHUNK = 256


class ScheduledSeq(PromptSeq, Protocol):
    """What the runner reads from the optimized scheduler's sequence: what the prompt logprobs read, and more."""

    @property
    def num_tokens(self) -> int: ...
    @property
    def num_cached_tokens(self) -> int: ...
    @property
    def num_scheduled_tokens(self) -> int: ...
    @property
    def last_token(self) -> int: ...


@dataclass(frozen=True)
class DrawParams:
    """How one request's tokens are drawn; ``seed`` is always set (the engine draws one if the user did not).
    ``logprobs``, ``prompt_logprobs``: the top alternatives its request wants with each drawn token's and each
    prompt token's logprob, -1 for none; ``prompt_from``: the first prompt position not yet covered (ENG-20)."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    logprobs: int = -1
    prompt_logprobs: int = -1
    prompt_from: int = 0


I64 = npt.NDArray[np.int64]


@dataclass
class StepMessage:
    """One step as every tensor-parallel rank runs it (TP-7; optimized/parallel/step.py puts it on the wire).
    ``StepInputs`` adds what rank 0 alone needs."""

    is_prefill: bool
    graphed: bool
    input_ids: I64
    positions: I64
    slot_mapping: I64
    cu_seqlens_q: I64
    context_lens: I64
    block_tables: I64
    logit_rows: I64


class CollectiveError(RuntimeError):
    """A tensor-parallel rank failed (died, raised or timed out); optimized/parallel/'s TensorParallelError."""


class StepBroadcast(Protocol):
    """Rank 0's tensor-parallel group, as its runner uses it (optimized/parallel/group.py's ``Group``)."""

    def send_step(self, step: StepMessage) -> None:
        """The step to every worker, which runs this very forward on its shard."""
        ...

    def fail_here(self, cause: BaseException) -> CollectiveError:
        """End the group naming rank 0 and ``cause``, so no worker waits out a collective (TP-9)."""
        ...


class RankGroup(TensorParallel, StepBroadcast, Protocol):
    """A rank's group: the collectives its model piece calls, and rank 0's step broadcast."""


@dataclass
class StepInputs(StepMessage):
    """One step's inputs: what every tensor-parallel rank runs (``StepMessage``, TP-7) and, for rank 0 alone, which
    sequences of the batch get a token."""

    sample_rows: I64


def _block_tables(seqs: Sequence[ScheduledSeq]) -> I64:
    width = max(len(s.block_table) for s in seqs)
    table = np.full((len(seqs), width), -1, dtype=np.int64)
    for i, s in enumerate(seqs):
        table[i, : len(s.block_table)] = s.block_table
    return table


def prepare(seqs: Sequence[ScheduledSeq], is_prefill: bool, block_size: int, graphed: bool = False) -> StepInputs:
    """The flat batch of one step: each sequence's granted positions, their slots and the rows to sample."""
    num_tokens = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=len(seqs))
    if is_prefill:
        starts = np.fromiter((s.num_cached_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        ends = starts + np.fromiter((s.num_scheduled_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        input_ids = np.concatenate(
            # A view of each chunk: no list of the whole sequence per step.
            [s.stored_tokens()[a:b] for s, a, b in zip(seqs, starts, ends, strict=True)]
        )
    else:
        ends = num_tokens
        starts = ends - 1
        input_ids = np.fromiter((s.last_token for s in seqs), dtype=np.int64, count=len(seqs))
    lengths = ends - starts
    cu = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    positions = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1] - starts, lengths)
    block_tables = _block_tables(seqs)
    sample_rows = np.flatnonzero(ends == num_tokens)
    return StepInputs(
        is_prefill=is_prefill,
        graphed=graphed,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=batch_slot_mapping(block_tables, starts, ends, block_size),
        cu_seqlens_q=cu,
        context_lens=ends,
        block_tables=block_tables,
        sample_rows=sample_rows,
        logit_rows=cu[1:][sample_rows] - 1,
    )


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        *,
        max_num_seqs: int = 256,
        enforce_eager: bool = True,
        graph_factory: GraphFactory | None = None,
        tp: StepBroadcast | None = None,
    ) -> None:
        """``graph_factory`` makes the decode graphs (default: CUDA graphs on CUDA, eager stand-ins elsewhere);
        ``tp``: this rank's tensor-parallel group (the model is then its shard and the cache holds its KV heads)."""
        c = model.local_config
        self.tp = tp
        param = model.embed_tokens.weight
        self.model = model
        self.backend = backend
        self.device = param.device
        self.dtype = param.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim)
        # Zeroed, so that masked-out slots never hold NaN garbage. A layer's k and v caches are adjacent, so the
        # CPU decode fetches both with one gather (kernels.paged_attention).
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_views = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(c.num_layers)]
        self.cos_sin = rotary_cos_sin(c.head_dim, max_model_len, c.rope_theta, self.dtype, self.device)
        self.graph_steps = 0  # decode steps served by the graph runner
        self.row_chunk = CPU_ROW_CHUNK
        # Told each step's sampled sequences and their logits rows (the model's dtype, one row each), before the draw.
        self.logits_observer: Callable[[list[ScheduledSeq], torch.Tensor], None] | None = None
        self.step_logprobs: dict[int, SeqLogprobs] = {}  # the last step's, by seq_id, for requests that asked
        self.graphs: GraphRunner | None = None
        if not enforce_eager:
            self.graphs = self._graph_runner(max_num_seqs, blocks_for(max_model_len, block_size), graph_factory)

    def _graph_runner(self, max_batch: int, max_blocks: int, factory: GraphFactory | None) -> GraphRunner:
        on_cuda = self.device.type == "cuda"
        if on_cuda and not self.backend.capturable:
            raise ValueError(
                f"enforce_eager=False on CUDA needs a capturable attention backend ('triton' or 'flash-attn'), "
                f"not {self.backend.name!r}"
            )
        if factory is None and on_cuda:
            factory = cuda_graph_factory()
        graphs = GraphRunner(self._graph_forward, max_batch, max_blocks, self.device, factory)
        if on_cuda:
            with torch.inference_mode():
                graphs.capture_all()
        return graphs

    def _graph_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: DecodeMetadata) -> torch.Tensor:
        ctx = AttentionContext(
            backend=self.backend,
            is_prefill=False,
            slot_mapping=meta.slot_mapping,
            cu_seqlens_q=meta.context_lens,  # unused by decode
            context_lens=meta.context_lens,
            block_tables=meta.block_tables,
            cos_sin=self.cos_sin,
        )
        out: torch.Tensor = self.model(input_ids, positions, ctx, self.kv_views)
        return out

    def _tensor(self, a: I64, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.from_numpy(a).to(device=self.device, dtype=dtype)

    @torch.inference_mode()
    def run(self, seqs: Sequence[ScheduledSeq], is_prefill: bool, draws: Sequence[DrawParams]) -> list[int]:
        """One forward over the batch; a token for each sequence (``PLACEHOLDER`` where none is drawn)."""
        if is_prefill:
            return self._run(seqs, True, draws)
        if self.graphs is not None and len(seqs) <= self.graphs.max_batch:
            return self._run(seqs, False, draws, graphed=True)
        if self.backend.reads_cache_in_place:
            # Its cost follows each row's own context, so the scheduler's order is as good as any.
            return self._run(seqs, False, draws)
        # It gathers its table's width: rows by context length, so a planned range gathers only about its own width.
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].num_tokens)
        drawn = self._run([seqs[i] for i in order], False, [draws[i] for i in order])
        tokens = [PLACEHOLDER] * len(seqs)
        for i, t in zip(order, drawn, strict=True):
            tokens[i] = t
        return tokens

    def _run(
        self, seqs: Sequence[ScheduledSeq], is_prefill: bool, draws: Sequence[DrawParams], graphed: bool = False
    ) -> list[int]:
        """One forward, rows in the order given; ``graphed`` decode steps run through the graph runner."""
        inp = prepare(seqs, is_prefill, self.block_size, graphed)
        wants = asked(draws)  # ENG-19: a step nobody asked logprobs of does none of their work
        plan = prompt_plan(seqs, draws, inp.cu_seqlens_q, inp.context_lens) if wants and is_prefill else None
        step = inp if plan is None else replace(inp, logit_rows=np.concatenate([inp.logit_rows, plan.rows]))
        logits = self.forward(step) if self.tp is None else self._forward_everywhere(self.tp, step)
        tokens = [PLACEHOLDER] * len(seqs)
        if logits is None:
            return tokens
        prompt_logits = None
        if plan is not None:  # the prompt rows after the sampled ones, then the cached positions recomputed
            logits, prompt_logits = logits[: len(inp.logit_rows)], logits[len(inp.logit_rows) :]
            if plan.side is not None:
                side = StepMessage(is_prefill=True, graphed=False, **plan.side)
                cached = self.forward(side) if self.tp is None else self._forward_everywhere(self.tp, side)
                assert cached is not None
                prompt_logits = torch.cat([prompt_logits, cached])
        if self.logits_observer is not None and len(inp.sample_rows):
            self.logits_observer([seqs[i] for i in inp.sample_rows.tolist()], logits)
        drawn = self._sample(logits.float(), [draws[i] for i in inp.sample_rows], inp.context_lens[inp.sample_rows])
        for i, t in zip(inp.sample_rows.tolist(), drawn, strict=True):
            tokens[i] = t
        if wants:
            self.step_logprobs = step_logprobs(seqs, draws, inp.sample_rows, drawn, logits, plan, prompt_logits)
        return tokens

    def take_logprobs(self) -> dict[int, SeqLogprobs]:
        """The last step's logprobs by seq_id (ENG-19), once; empty when no request of it asked."""
        got, self.step_logprobs = self.step_logprobs, {}
        return got

    def _forward_everywhere(self, tp: StepBroadcast, step: StepMessage) -> torch.Tensor | None:
        """Rank 0 under tensor parallelism: the step to the workers, then its own forward (TP-7). An exception of
        rank 0's own ends the group at once, naming rank 0, so no worker waits out a collective (TP-9); an
        interruption (KeyboardInterrupt) ends it too and propagates unchanged."""
        try:
            tp.send_step(step)  # the workers run this very forward on their shards
            return self.forward(step)
        except CollectiveError:
            raise
        except Exception as e:
            raise tp.fail_here(e) from e
        except BaseException as e:
            tp.fail_here(e)
            raise

    @torch.inference_mode()
    def forward(self, step: StepMessage) -> torch.Tensor | None:
        """The step's forward; the logits of its ``logit_rows`` (None when there are none). Under tensor
        parallelism every rank calls this with the same step, and rank 0 gets the whole logits (TP-7)."""
        input_ids, positions = self._tensor(step.input_ids), self._tensor(step.positions)
        if step.graphed:
            assert self.graphs is not None
            hidden = self.graphs.run(
                input_ids,
                positions,
                self._tensor(step.slot_mapping),
                self._tensor(step.context_lens, torch.int32),
                self._tensor(step.block_tables, torch.int32),
            )
            self.graph_steps += 1
        else:
            ctx = AttentionContext(
                backend=self.backend,
                is_prefill=step.is_prefill,
                slot_mapping=self._tensor(step.slot_mapping),
                cu_seqlens_q=self._tensor(step.cu_seqlens_q, torch.int32),
                context_lens=self._tensor(step.context_lens, torch.int32),
                block_tables=self._tensor(step.block_tables, torch.int32),
                cos_sin=self.cos_sin,
            )
            if not step.is_prefill and self.backend.needs_decode_plan:
                ctx.decode_plan = self.backend.plan_decode(ctx.context_lens, ctx.block_tables, self.block_size)
            row_chunk = self.row_chunk if self.device.type == "cpu" else 0
            hidden = self.model(input_ids, positions, ctx, self.kv_views, row_chunk)
        if len(step.logit_rows) == 0:
            return None
        out: torch.Tensor = self.model.logits(hidden[self._tensor(step.logit_rows)])
        return out

    def _sample(self, logits: torch.Tensor, rows: list[DrawParams], positions: I64) -> list[int]:
        """``kernels.sampling.sample`` per row; greedy rows take the argmax directly (sample's greedy branch)."""
        tokens = logits.argmax(dim=-1)
        drawn_rows = [i for i, d in enumerate(rows) if d.temperature > 0]
        if drawn_rows:
            picked = [rows[i] for i in drawn_rows]
            index = torch.tensor(drawn_rows, dtype=torch.int64, device=self.device)
            tokens[index] = sample(
                logits[index],
                torch.tensor([d.temperature for d in picked], dtype=torch.float32, device=self.device),
                torch.tensor([d.top_k for d in picked], dtype=torch.int64, device=self.device),
                torch.tensor([d.top_p for d in picked], dtype=torch.float32, device=self.device),
                torch.tensor([d.seed for d in picked], dtype=torch.int64, device=self.device),
                self._tensor(positions[drawn_rows]),
            )
        out: list[int] = tokens.tolist()
        return out
