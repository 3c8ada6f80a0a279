"""The step protocol: what rank 0 sends the workers each step, and the stop message (TP-7).

Invariant: a worker runs exactly the forward rank 0 runs, on exactly rank 0's inputs: rank 0 broadcasts a fixed
header (the operation, prefill or decode, graphed or eager, and the array lengths) over the control group, then
one int64 payload holding the step's token ids, positions, slot mapping, cumulative query lengths, context lengths,
block tables and the rows whose logits are wanted, over the compute group. Nothing else crosses: the scheduler,
the shadow, sampling and detokenization stay on rank 0 (TP-6).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from optimized.engine.model_runner import StepMessage

if TYPE_CHECKING:
    from optimized.parallel.group import Group

STEP, STOP = 1, 2
_HEADER = 8  # op, is_prefill, graphed, tokens, seqs, table width, logit rows, spare


def _header(op: int, m: StepMessage | None = None) -> torch.Tensor:
    h = torch.zeros(_HEADER, dtype=torch.int64)
    h[0] = op
    if m is not None:
        seqs, width = m.block_tables.shape
        h[1:7] = torch.tensor([m.is_prefill, m.graphed, len(m.input_ids), seqs, width, len(m.logit_rows)])
    return h


def send_step(group: Group, m: StepMessage) -> None:
    """Rank 0: the step's header and inputs to every worker."""
    group.broadcast(_header(STEP, m).to(group.device), idle=True)
    parts = (m.input_ids, m.positions, m.slot_mapping, m.cu_seqlens_q, m.context_lens, m.block_tables.reshape(-1),
             m.logit_rows)
    payload = torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))
    group.broadcast(payload.to(group.device))


def send_stop(group: Group) -> None:
    """Rank 0: the workers leave their loop and exit."""
    group.broadcast(_header(STOP).to(group.device), idle=True)


def receive_step(group: Group) -> StepMessage | None:
    """A worker: the next step from rank 0 (waiting as long as rank 0 is idle), or None when told to stop."""
    h = group.broadcast(torch.zeros(_HEADER, dtype=torch.int64, device=group.device), idle=True).cpu().tolist()
    if h[0] == STOP:
        return None
    if h[0] != STEP:
        raise RuntimeError(f"tensor-parallel step header with unknown operation {h[0]}")
    _, prefill, graphed, tokens, seqs, width, rows, _ = h
    sizes = [tokens, tokens, tokens, seqs + 1, seqs, seqs * width, rows]
    payload = torch.empty(sum(sizes), dtype=torch.int64, device=group.device)
    flat = group.broadcast(payload).cpu().numpy()
    cuts = np.cumsum(sizes)[:-1]
    ids, pos, slots, cu, ctx, tables, logit_rows = np.split(flat, cuts)
    return StepMessage(bool(prefill), bool(graphed), ids, pos, slots, cu, ctx, tables.reshape(seqs, width), logit_rows)
