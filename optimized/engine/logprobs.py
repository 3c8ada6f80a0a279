"""Logprobs of one step's rows, for the requests that asked (ENG-18..ENG-20).

Invariant: a row's logprobs are a function of that row's logits alone (``kernels.sampling.log_probs``, row by
row), so they are as batch-invariant as the logits. A step in which no request asked computes none of this.
Prompt logprobs need the logits of prompt positions, which the runner computes only for the requests that
asked, chunk by chunk; positions whose KV came from the prefix cache were never computed this time, so they are
recomputed by a second forward over them that stores no KV (slot -1, KERN-1) and reads the cached KV.
Position ``p``'s logits give prompt token ``p + 1``'s logprob; a request's ``prompt_from`` is the first position
not yet covered, so a chunk, a cache hit or a recompute after preemption never covers a position twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt
import torch

from kernels.sampling import log_probs, token_ranks, top_logprobs
from optimized.engine.sampling_params import Logprob

if TYPE_CHECKING:
    from optimized.engine.model_runner import DrawParams

I64 = npt.NDArray[np.int64]


class AskingDraw(Protocol):
    """What a draw says of the logprobs its request wants (``model_runner.DrawParams``); -1: none."""

    @property
    def logprobs(self) -> int: ...
    @property
    def prompt_logprobs(self) -> int: ...
    @property
    def prompt_from(self) -> int: ...


class PromptSeq(Protocol):
    """What the prompt logprobs read of a scheduled sequence (the runner's ``ScheduledSeq`` extends it)."""

    def stored_tokens(self) -> I64: ...
    @property
    def seq_id(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def block_table(self) -> list[int]: ...


@dataclass(frozen=True)
class TokenLogprobs:
    """One token's logprob and rank, and its row's ``top`` (token id, logprob) pairs, most likely first."""

    token: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]

    def as_dict(self) -> dict[int, Logprob]:
        """ENG-18's shape: the top tokens by rank, then the token itself if it is not among them."""
        out = {t: Logprob(v, rank) for rank, (t, v) in enumerate(self.top, 1)}
        if self.token not in out:
            out[self.token] = Logprob(self.logprob, self.rank)
        return out


@dataclass
class SeqLogprobs:
    """A sequence's logprobs from one step: its drawn token's, and its prompt tokens' from ``prompt_from + 1``."""

    sampled: TokenLogprobs | None = None
    prompt: list[TokenLogprobs] = field(default_factory=list)


def asked(draws: Sequence[AskingDraw]) -> bool:
    return any(d.logprobs >= 0 or d.prompt_logprobs >= 0 for d in draws)


ROWS_AT_ONCE = 256  # rows whose [rows, vocab] intermediates exist at once: a long prompt's are taken in slices


def row_logprobs(logits: torch.Tensor, tokens: list[int], counts: list[int]) -> list[TokenLogprobs]:
    """Row i's ``tokens[i]`` logprob, rank and ``counts[i]`` top alternatives (at most the vocabulary).

    Every value is a function of its own row (ENG-19), so taking the rows in slices of ``ROWS_AT_ONCE`` changes no
    bit; it bounds the log-softmax copy and the ranking's masks by the slice, not by the prompt."""
    if len(tokens) > ROWS_AT_ONCE:
        return [got for a in range(0, len(tokens), ROWS_AT_ONCE)
                for got in row_logprobs(logits[a : a + ROWS_AT_ONCE], tokens[a : a + ROWS_AT_ONCE],
                                        counts[a : a + ROWS_AT_ONCE])]
    if not tokens:
        return []
    lp = log_probs(logits)
    k = min(max(counts), lp.shape[-1])
    ids, values = top_logprobs(lp, k)
    chosen, ranks = token_ranks(lp, torch.tensor(tokens, dtype=torch.int64, device=lp.device))
    top_ids, top_values = ids.tolist(), values.tolist()
    return [TokenLogprobs(t, c, r, tuple(zip(i[:n], v[:n], strict=True)))
            for t, c, r, i, v, n in zip(tokens, chosen.tolist(), ranks.tolist(), top_ids, top_values, counts,
                                        strict=True)]


@dataclass
class PromptPlan:
    """Which rows of a prefill step give prompt logprobs: ``rows`` of the step itself, then every row of
    ``side`` (the cached positions, recomputed); ``owners`` and ``positions`` say whose position each is, in
    that order."""

    rows: I64
    owners: list[int]  # index in the batch
    positions: list[int]
    side: dict[str, I64] | None  # a StepMessage's arrays (no KV stored), or None


def prompt_plan(seqs: Sequence[PromptSeq], draws: Sequence[AskingDraw], cu_seqlens_q: I64,
                ends: I64) -> PromptPlan | None:
    """The prompt positions this prefill step must give logits for, or None when there are none."""
    rows: list[I64] = []
    owners: list[int] = []
    positions: list[int] = []
    side_owners: list[int] = []
    side_spans: list[tuple[int, int]] = []
    for i, (s, d) in enumerate(zip(seqs, draws, strict=True)):
        if d.prompt_logprobs < 0:
            continue
        end = int(ends[i])
        start = end - int(cu_seqlens_q[i + 1] - cu_seqlens_q[i])
        first, last = d.prompt_from, min(end, s.num_prompt_tokens - 1)
        if first >= last:
            continue
        if first < start:  # cached this time (a prefix-cache hit): recomputed without storing
            side_spans.append((first, min(start, last)))
            side_owners.append(i)
        a = max(first, start)
        if a < last:
            rows.append(np.arange(a, last, dtype=np.int64) - start + cu_seqlens_q[i])
            owners += [i] * (last - a)
            positions += range(a, last)
    if not owners and not side_owners:
        return None
    side = _side_step([seqs[i] for i in side_owners], side_spans) if side_owners else None
    for i, (a, b) in zip(side_owners, side_spans, strict=True):
        owners += [i] * (b - a)
        positions += range(a, b)
    return PromptPlan(np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64), owners, positions, side)


def _side_step(seqs: Sequence[PromptSeq], spans: list[tuple[int, int]]) -> dict[str, I64]:
    """A prefill over cached positions ``spans`` that reads the cached KV and stores none."""
    lengths = np.array([b - a for a, b in spans], dtype=np.int64)
    cu = np.zeros(len(spans) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    width = max(len(s.block_table) for s in seqs)
    tables = np.full((len(seqs), width), -1, dtype=np.int64)
    for i, s in enumerate(seqs):
        tables[i, : len(s.block_table)] = s.block_table
    return {
        "input_ids": np.concatenate([s.stored_tokens()[a:b] for s, (a, b) in zip(seqs, spans, strict=True)]),
        "positions": np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in spans]),
        "slot_mapping": np.full(int(cu[-1]), -1, dtype=np.int64),
        "cu_seqlens_q": cu,
        "context_lens": np.array([b for _, b in spans], dtype=np.int64),
        "block_tables": tables,
        "logit_rows": np.arange(int(cu[-1]), dtype=np.int64),
    }


def step_logprobs(seqs: Sequence[PromptSeq], draws: Sequence[AskingDraw], sample_rows: I64, drawn: list[int],
                  sample_logits: torch.Tensor, plan: PromptPlan | None,
                  prompt_logits: torch.Tensor | None) -> dict[int, SeqLogprobs]:
    """The step's logprobs by seq_id: each asking sampled row's, and the prompt positions of ``plan``."""
    out: dict[int, SeqLogprobs] = {}
    picked = [j for j, i in enumerate(sample_rows.tolist()) if draws[i].logprobs >= 0]
    if picked:
        index = torch.tensor(picked, dtype=torch.int64, device=sample_logits.device)
        owners = [int(sample_rows[j]) for j in picked]
        got = row_logprobs(sample_logits[index], [drawn[j] for j in picked], [draws[i].logprobs for i in owners])
        for i, lp in zip(owners, got, strict=True):
            out[seqs[i].seq_id] = SeqLogprobs(sampled=lp)
    if plan is not None and prompt_logits is not None:
        tokens = [int(seqs[i].stored_tokens()[p + 1]) for i, p in zip(plan.owners, plan.positions, strict=True)]
        got = row_logprobs(prompt_logits, tokens, [draws[i].prompt_logprobs for i in plan.owners])
        by_seq: dict[int, list[tuple[int, TokenLogprobs]]] = {}
        for i, p, lp in zip(plan.owners, plan.positions, got, strict=True):
            by_seq.setdefault(i, []).append((p, lp))
        for i, pairs in by_seq.items():
            pairs.sort(key=lambda pair: pair[0])  # the recomputed cached positions come before the step's own
            out.setdefault(seqs[i].seq_id, SeqLogprobs()).prompt = [lp for _, lp in pairs]
    return out


def keep(got: SeqLogprobs, logprobs: list[dict[int, Logprob]] | None,
         prompt_logprobs: list[dict[int, Logprob] | None] | None, draw: DrawParams,
         num_prompt_tokens: int) -> DrawParams:
    """Append a step's logprobs to a request's; its draw, asking from the first prompt position not covered
    (nothing once all are: a recompute after preemption asks for none again)."""
    if got.sampled is not None and logprobs is not None:
        logprobs.append(got.sampled.as_dict())
    if not got.prompt or prompt_logprobs is None:
        return draw
    prompt_logprobs.extend(lp.as_dict() for lp in got.prompt)
    covered = len(prompt_logprobs) - 1  # positions 0 .. covered - 1 (the first token has none)
    done = covered >= num_prompt_tokens - 1
    return replace(draw, prompt_from=covered, prompt_logprobs=-1 if done else draw.prompt_logprobs)
