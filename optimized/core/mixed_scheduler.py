"""The optimized ``mixed`` policy (stall-free batching): the reference's decisions on the core's machinery.

Invariants (POLICY-2..4, each the reference's): a step decodes the running
sequences first, one token each (the lesson's decode loop, as the decode group:
``running[:max_num_seqs]`` advanced by its clock), then spends what is left of
the token budget and of ``max_num_seqs`` on prefill chunks of ``waiting``, in
order, on cached hashes; only the last prefill may be cut short, and it stays
at the front of ``waiting`` holding its blocks; when a decode needs a block and
none is free, that prefill's blocks go first (it keeps its place), then the
newest running sequence, as in the lesson; a step whose decode loop found no
block for someone admits no prefill. The batch is the decodes, a prefix of
``running``, then the prefills; its flag is whether it holds a prefill, and
``postprocess`` advances the decodes through the group and the prefills one at
a time, in batch order, which is the reference's order of every release and
registration. Where the reference's ``assert batch`` fires, ``EmptyDecodeError``
with the state it leaves. The reporting (preempted, prefix hits, lookups) is
what ``ReferencePort`` reads off the reference's queues.
"""

from __future__ import annotations

from typing import Any

from optimized.core.errors import EmptyDecodeError, refuse_a_second_schedule
from optimized.core.port import ScheduleOutput
from optimized.core.scheduler import RUNNING, Scheduler
from optimized.core.sequence import I64, Sequence

__all__ = ["MixedScheduler"]


class MixedScheduler(Scheduler):
    def schedule(self) -> ScheduleOutput[Sequence]:
        """The step's batch, decodes first then prefills, and whether it holds a prefill (POLICY-2); refused while
        the last batch awaits its postprocess, as the core's (OPT-27)."""
        refuse_a_second_schedule(self._step_batch)
        group = self._group
        preempted, short_of_blocks = self._decode_members()
        decodes = group.members[:]
        if short_of_blocks or not self._waiting:  # POLICY-3: a step that preempted admits no prefill
            prefills: list[Sequence] = []
            hit_blocks = query_tokens = 0
        else:
            prefills, hit_blocks, query_tokens = self._prefill_chunks(
                self.max_num_batched_tokens - len(decodes), self.max_num_seqs - len(decodes))
        if not decodes and not prefills:
            raise EmptyDecodeError("schedule(): nothing fits and nothing is running (the reference's assert)")
        group.inflight = bool(decodes)
        if prefills:
            out = ScheduleOutput(decodes + prefills, True, (), hit_blocks * self.block_size, query_tokens)
            return self._awaiting(out, out.batch[:])
        # A decode step: its batch is a copy of the members, which stay as they are until the postprocess.
        return self._awaiting(ScheduleOutput(decodes, False, preempted, 0), group.members)

    def _release_before_preempting(self) -> bool:
        """POLICY-3: a prefill cut short (the front of ``waiting``, holding blocks) is the newest admitted: its
        chunks go before any running sequence is preempted; it keeps its place."""
        waiting = self._waiting
        if waiting and waiting[0].block_table:
            self.block_manager.deallocate(waiting[0])
            return True
        return False

    def _prefill_chunks(self, budget: int, seats: int) -> tuple[list[Sequence], int, int]:
        """The reference's prefill loop with the budget and seats the decodes left; only the last is cut short.
        Also the cached blocks and the tokens of the sequences it allocated for (the port's report)."""
        scheduled: list[Sequence] = []
        hit_blocks = query_tokens = 0
        waiting, running, bm = self._waiting, self._running, self.block_manager
        while waiting and len(scheduled) < seats and budget > 0:
            seq = waiting[0]
            core = seq.core
            if not seq.block_table:
                num_cached_blocks = bm.can_allocate(seq)
                if num_cached_blocks == -1:
                    break
                bm.allocate(seq, num_cached_blocks)
                hit_blocks += num_cached_blocks
                query_tokens += core.ntok
            num_tokens = core.ntok - core.ncached
            grant = num_tokens if num_tokens <= budget else budget
            core.nsched = grant
            budget -= grant
            scheduled.append(seq)
            if grant < num_tokens:
                break  # the budget is spent: it stays at the front of waiting, partly prefilled
            core.status = RUNNING
            waiting.popleft()
            running.append(seq)
        return scheduled, hit_blocks, query_tokens

    def _postprocess_step(self, seqs: list[Sequence], tokens: I64, is_prefill: bool) -> list[Sequence]:
        """The reference's postprocess of a mixed step, given the very list: the decodes (the batch's first ``m``,
        the members) through the group, then the prefills in batch order; who finished, in batch order. Anything
        else (a decode-only step, a copy of the batch, a step without decodes) is the core scheduler's."""
        group = self._group
        m = len(group.members)
        if seqs is self._last_batch and group.inflight and m < len(seqs):
            return self._postprocess_group(tokens[:m]) + self._postprocess_each(seqs[m:], tokens[m:].tolist(),
                                                                                 is_prefill)
        return super()._postprocess_step(seqs, tokens, is_prefill)  # a decode step's list takes the group's path

    def policy_state(self) -> dict[str, Any]:
        return {"policy": "mixed"}  # no state of its own beyond the lesson's
