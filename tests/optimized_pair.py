"""Shared drivers of the optimized-scheduler tests: the reference and the optimized scheduler in lockstep.

Both are driven through the scheduler port (ARCH-4): the reference by its adapter, which reports whom a step
preempted and whom a postprocess finished as the optimized scheduler does.
"""


from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import optimized
import reference
from invariants import SeqView, check_batch, check_state, seq_view, snapshot
from optimized.core.port import PortFactory, ScheduleOutput
from optimized.core.scheduler import Scheduler, SchedulerConfig, Sequence
from optimized.verify.conformance import implementation, parse_workload
from optimized.verify.reference_port import ReferencePort

SAMPLES_FILE = Path(optimized.__file__).parent / "verify" / "data" / "conformance.jsonl"
SAMPLES = [json.loads(line) for line in SAMPLES_FILE.read_text().splitlines() if line.strip()]


def opt_impl() -> PortFactory:
    return implementation("optimized")


def check_step(scheduler: Any, batch: list[Any], is_prefill: bool) -> None:
    state = snapshot(scheduler)
    found = [*check_batch(state, [seq_view(s) for s in batch], is_prefill),
             *check_state(state, between_steps=False)]
    assert not found, found


def check_between(scheduler: Any, batch: list[Any], is_prefill: bool) -> None:
    found = check_state(snapshot(scheduler))
    assert not found, found


def twin_run(workload: dict[str, Any], steps: int) -> tuple[ReferencePort, Scheduler]:
    """Drive both schedulers with the same requests and tokens; compare batches on the way."""
    w = parse_workload(workload)
    config = SchedulerConfig(**w.config)
    ref, opt = ReferencePort(config), Scheduler(config)
    for r in w.requests:
        ref.add(ref.new_sequence(r.prompt, r.max_tokens, r.ignore_eos))
        opt.add(opt.new_sequence(r.prompt, r.max_tokens, r.ignore_eos))
    for _ in range(steps):
        if ref.is_finished():
            break
        (rb, rp), (ob, op) = ref.schedule(), opt.schedule()
        assert rp == op
        assert [(len(s), s.num_scheduled_tokens, s.block_table) for s in rb] == \
               [(len(s), s.num_scheduled_tokens, s.block_table) for s in ob]
        tokens = [1 + (len(s) % 5) for s in rb]
        ref.postprocess(rb, tokens, rp)
        opt.postprocess(ob, tokens, op)
    return ref, opt


def requests(n: int, prompt: int, max_tokens: int, shared: int = 0) -> list[dict[str, Any]]:
    return [{"id": i, "prompt": [9] * shared + [i + 1] * prompt, "max_tokens": max_tokens, "ignore_eos": True,
             "arrive": 0, "output": [1] * max_tokens} for i in range(n)]


class Pair:
    """The reference and the optimized scheduler on one configuration, fed the same requests and tokens."""

    def __init__(self, **config: Any) -> None:
        config.setdefault("eos", 0)
        self.block_size = config["block_size"]
        self.ref = ReferencePort(SchedulerConfig(**config))
        self.opt = Scheduler(SchedulerConfig(**config))
        self.ref_seqs: list[reference.Sequence] = []
        self.opt_seqs: list[Sequence] = []
        self.outputs: list[ScheduleOutput[Sequence]] = []

    def add(self, prompt: list[int], max_tokens: int, ignore_eos: bool = True, stops: frozenset[int] = frozenset(),
            ) -> int:
        r = self.ref.new_sequence(prompt, max_tokens, ignore_eos)
        o = self.opt.new_sequence(prompt, max_tokens, ignore_eos)
        self.ref.add(r, stops)
        self.opt.add(o, stops)
        self.ref_seqs.append(r)
        self.opt_seqs.append(o)
        return len(self.ref_seqs) - 1

    def step(self, tokens: Any = None, copy_batch: bool = False) -> bool:
        """One schedule()+postprocess() on both; the batches must agree. False once both are idle.

        ``copy_batch``: the optimized scheduler's postprocess gets a copy of its batch (OPT-3).
        """
        if self.ref.is_finished():
            assert self.opt.is_finished()
            return False
        holding = {id(s) for s in self.ref_seqs if s.block_table}
        ref_out = self.ref.schedule()
        rb, rp = ref_out.batch, ref_out.is_prefill
        out = self.opt.schedule()
        self.outputs.append(out)
        ob, op = out.batch, out.is_prefill
        assert rp == op
        assert [self.ref_seqs.index(s) for s in rb] == [self.opt_seqs.index(s) for s in ob]
        assert [(s.num_scheduled_tokens, s.block_table) for s in rb] == \
               [(s.num_scheduled_tokens, s.block_table) for s in ob]
        # OPT-22: what the step reports is what the reference did.
        assert [self.opt_seqs.index(s) for s in out.preempted] == [self.ref_seqs.index(s) for s in ref_out.preempted]
        admitted = [s.num_cached_tokens for s in rb if id(s) not in holding] if rp else []
        assert out.prefix_hit_tokens == ref_out.prefix_hit_tokens == sum(admitted)
        looked_up = sum(s.num_tokens for s in rb if id(s) not in holding) if rp else 0
        assert out.prefix_query_tokens == ref_out.prefix_query_tokens == looked_up
        model = [1 + (len(s) * 7) % 5 for s in rb]
        ref_finished = self.ref.postprocess(rb, model, rp)
        self.check_calendar()
        finished = self.opt.postprocess(list(ob) if copy_batch else ob, model if tokens is None else tokens(model), op)
        self.check_calendar()
        assert [self.opt_seqs.index(s) for s in finished] == [self.ref_seqs.index(s) for s in ref_finished]
        return True

    def run(self, arrivals: list[tuple[list[int], int, int]], invariants: bool = True) -> int:
        """Add each (prompt, max_tokens, step) just before that step, step until both are idle, agreeing after
        every step; the number of steps."""
        pending = sorted(arrivals, key=lambda a: a[2])
        steps = 0
        while pending or self.step():
            while pending and pending[0][2] <= steps:
                prompt, max_tokens, _ = pending.pop(0)
                self.add(prompt, max_tokens)
            steps += 1
            self.agree(invariants)
        return steps

    def check_calendar(self) -> None:
        """OPT-3: the finish calendar books every decode-group member exactly once, and has no empty day."""
        group = self.opt._group
        booked = [id(seq) for day in group.finishes.values() for seq in day]
        assert all(group.finishes.values())
        assert sorted(booked) == sorted(id(seq) for seq in group.members)

    def agree(self, invariants: bool = True) -> None:
        """OPT-1: the same queues, sequences and block-manager state; every invariant holds (``invariants``: a
        test that forces hash collisions turns this off, since INV-2, no block twice in one table, assumes none,
        and the reference breaks it too then)."""
        r, o = snapshot(self.ref), snapshot(self.opt)
        if invariants:
            assert check_state(o) == []
        assert (r.free_block_ids, r.used_block_ids, r.hash_to_block_id) == \
               (o.free_block_ids, o.used_block_ids, o.hash_to_block_id)
        assert [(b.ref_count, b.hash, b.token_ids) for b in r.blocks] == \
               [(b.ref_count, b.hash, b.token_ids) for b in o.blocks]
        for attr in ("waiting", "running"):
            assert [self.ref_seqs.index(s) for s in getattr(self.ref, attr)] == \
                   [self.opt_seqs.index(s) for s in getattr(self.opt, attr)]
        for rs, os_ in zip(self.ref_seqs, self.opt_seqs, strict=True):
            assert unnumbered(seq_view(rs)) == unnumbered(seq_view(os_))


def unnumbered(view: SeqView) -> SeqView:
    """A sequence's view without its id: the two schedulers number their sequences independently."""
    return dataclasses.replace(view, seq_id=-1)


def expected_chain(prompt: list[int], block_size: int) -> list[int]:
    chain, h = [], -1
    for i in range(len(prompt) // block_size):
        h = reference.compute_hash(prompt[i * block_size : (i + 1) * block_size], h)
        chain.append(h)
    return chain


class Computed(list[int]):
    """Hashes ``chain_hashes`` just computed (the test wraps it), as opposed to hashes copied from another chain."""


class RecordedChain(list[int]):
    """A sequence's chain-hash cache that logs, per slot, whether it was hashed or taken from another chain.

    A hash is computed when it is appended one at a time, or extended with ``chain_hashes``'s result.
    """

    def __init__(self, order: int, hashed: list[tuple[int, int]], taken: list[tuple[int, int]]) -> None:
        super().__init__()
        self.order, self.hashed, self.taken = order, hashed, taken

    def append(self, h: int) -> None:
        self.hashed.append((self.order, len(self)))
        super().append(h)

    def extend(self, hs: Iterable[int]) -> None:
        log = self.hashed if isinstance(hs, Computed) else self.taken
        hs = list(hs)
        log.extend((self.order, len(self) + k) for k in range(len(hs)))
        super().extend(hs)
