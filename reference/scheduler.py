"""The lesson's scheduler, statement for statement (lesson 03, engine/scheduler.py).

Read it beside spec/scheduler.md: each block names the lesson's section (§) and
the lines of its scheduler.py it mirrors, and spec/scheduler.md has a section of
the same name stating that block's rules as clauses. Invariants the code keeps
(spec/invariants.md states them as clauses): every sequence is in exactly one
of ``waiting`` and ``running`` until it finishes; ``running`` followed by
``waiting`` is in arrival order; a batch is all-prefill or all-decode; only the
first sequence of a prefill batch may be left unfinished. ``assert
scheduled_seqs`` is kept exactly as the lesson has it: it can fire (spec
EDGE-2), and that is part of what this oracle reproduces.
"""

from __future__ import annotations

from collections import deque

from reference.block_manager import BlockManager
from reference.config import SchedulerConfig
from reference.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.eos = config.eos
        self.block_size = config.block_size
        self.block_manager = BlockManager(config.num_blocks, config.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        scheduled_seqs: list[Sequence] = []
        num_batched_tokens = 0

        # lesson §2, scheduler.py L29-55: the prefill loop, three limits at once.
        while self.waiting and len(scheduled_seqs) < self.max_num_seqs:  # limit 1: sequences
            seq = self.waiting[0]
            remaining = self.max_num_batched_tokens - num_batched_tokens  # limit 2: tokens
            if remaining == 0:
                break
            if not seq.block_table:
                num_cached_blocks = self.block_manager.can_allocate(seq)
                if num_cached_blocks == -1:  # limit 3: KV blocks
                    break
                num_tokens = seq.num_tokens - num_cached_blocks * self.block_size
            else:
                num_tokens = seq.num_tokens - seq.num_cached_tokens
            # lesson §3: only the first sequence of a batch may be chunked.
            if remaining < num_tokens and scheduled_seqs:
                break
            if not seq.block_table:
                self.block_manager.allocate(seq, num_cached_blocks)
            seq.num_scheduled_tokens = min(num_tokens, remaining)
            num_batched_tokens += seq.num_scheduled_tokens
            if seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens:
                seq.status = SequenceStatus.RUNNING
                self.waiting.popleft()
                self.running.append(seq)
            scheduled_seqs.append(seq)

        # lesson §1: a prefill batch, if any prefill fitted.
        if scheduled_seqs:
            return scheduled_seqs, True

        # lesson §4, scheduler.py L57-73: the decode loop; preempt when blocks run out.
        while self.running and len(scheduled_seqs) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:  # someone else can be sacrificed: the newest
                    self.preempt(self.running.pop())
                else:  # only this one is left
                    self.preempt(seq)
                    break
            else:  # runs only when the while ended without break
                seq.num_scheduled_tokens = 1
                seq.is_prefill = False
                self.block_manager.may_append(seq)
                scheduled_seqs.append(seq)
        assert scheduled_seqs
        # lesson §9 question 2: put the batch back at the front, in its order (FIFO).
        self.running.extendleft(reversed(scheduled_seqs))
        return scheduled_seqs, False

    # lesson §4 ②, scheduler.py L75-79: preemption discards the KV and recomputes later.
    def preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.is_prefill = True
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    # lesson §5, scheduler.py L81-92: the bookkeeping.
    def postprocess(self, seqs: list[Sequence], token_ids: list[int], is_prefill: bool) -> None:
        for seq, token_id in zip(seqs, token_ids):  # noqa: B905 (as the lesson writes it)
            self.block_manager.hash_blocks(seq)
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if is_prefill and seq.num_cached_tokens < seq.num_tokens:
                continue  # an unfinished chunk: its sample is discarded
            seq.append_token(token_id)
            if (not seq.ignore_eos and token_id == self.eos) or seq.num_completion_tokens == seq.max_tokens:
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
