"""BEYOND THE LESSON: the ``mixed`` policy, stall-free batching (spec/policies.md, POLICY-1..4).

The lesson's scheduler (reference/scheduler.py, unchanged) runs a step of
prefill or a step of decode, never both: while a long prompt is prefilled in
chunks, every running sequence waits. This one runs the decodes first, one
token each, and fills what is left of the token budget with prefill chunks, as
vLLM v1 and Sarathi-Serve do. Invariants, beyond the shared ones: the budget
bounds every step, decodes included; every running sequence is decoded in a
step unless a limit stops it or it is preempted; a step that preempted admits
no prefill (a preempted sequence is not taken back in the step that let it go);
only the last prefill of a step may be left unfinished, and it stays at the
front of ``waiting``, holding its blocks; it is the newest admitted sequence,
so when a decode needs a block it is the first to lose them (it keeps its
place). Everything else is the lesson's: the blocks, the newest
running sequence preempted first, ``postprocess``.
"""

from __future__ import annotations

from reference.scheduler import Scheduler
from reference.sequence import Sequence, SequenceStatus


class MixedScheduler(Scheduler):
    def schedule(self) -> tuple[list[Sequence], bool]:
        """The step's batch, decodes first then prefills, and whether it holds a prefill (postprocess takes that
        flag: a decode in a prefill step is postprocessed as a chunk that completes its sequence)."""
        decodes, preempted = self._decode()
        prefills = [] if preempted else self._prefill(self.max_num_batched_tokens - len(decodes), len(decodes))
        batch = decodes + prefills
        assert batch  # as the lesson's: reachable only when a sequence alone cannot fit the cache (EDGE-2)
        return batch, bool(prefills)

    def _decode(self) -> tuple[list[Sequence], bool]:
        """The lesson's decode loop; whether it preempted anyone. It needs no bound of its own by the budget: a
        sequence only starts running from a prefill that fit in what the decodes left, so ``running`` never holds
        more sequences than the budget has tokens."""
        scheduled: list[Sequence] = []
        preempted = False
        while self.running and len(scheduled) < self.max_num_seqs:  # never more running than the budget: below
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                preempted = True
                if self.waiting and self.waiting[0].block_table:  # a prefill cut short is the newest admitted:
                    self.block_manager.deallocate(self.waiting[0])  # its chunks go first, it stays at the front
                elif self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                seq.num_scheduled_tokens = 1
                seq.is_prefill = False
                self.block_manager.may_append(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled, preempted

    def _prefill(self, budget: int, seats: int) -> list[Sequence]:
        """The lesson's prefill loop with the budget and the seats the decodes left; only the last is cut short."""
        scheduled: list[Sequence] = []
        while self.waiting and seats + len(scheduled) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not seq.block_table:
                num_cached_blocks = self.block_manager.can_allocate(seq)
                if num_cached_blocks == -1:
                    break
                self.block_manager.allocate(seq, num_cached_blocks)
            num_tokens = seq.num_tokens - seq.num_cached_tokens
            seq.num_scheduled_tokens = min(num_tokens, budget)
            budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
            if seq.num_scheduled_tokens < num_tokens:
                break  # the budget is spent: this one stays at the front of waiting, partly prefilled
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
        return scheduled
