"""Survivors already explained: equivalent mutants and dead code, left out of the score with their reason (MUT-9).

An entry names a mutant by its file, the stripped text of its line and its
edit, not by line number, so it survives code moving within the file; an
entry's file follows targets.py when files move. Only survivors are matched:
a listed mutant that the tests kill is simply killed.
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.mutation.mutants import Mutant


@dataclass(frozen=True)
class Explained:
    path: str
    line: str  # the mutated line, stripped
    before: str
    after: str
    why: str  # "equivalent: ..." or "dead code: ..."
    previous: str = ""  # the line before, stripped, where the line alone is too common


EQUIVALENT_ARENA_SIZE = "equivalent: only how big the token array is, never which tokens a region holds"

EXPLAINED: tuple[Explained, ...] = (
    Explained("optimized/decode_group.py", "self.base_clock = 0", "0", "1",
              "equivalent: positions is empty until the first join, which sets base_clock"),
    Explained("optimized/decode_group.py", "self._next_gord += 1", "1", "2",
              "equivalent: only the order of the join ordinals is read"),
    Explained("optimized/decode_group.py", "seq._segments.clear()", "seq._segments.clear()", "pass",
              "equivalent: a deferred fill walks back from the newest segment, so stale older ones are never "
              "reached; clearing bounds memory only"),
    Explained("optimized/decode_group.py", "del self.finishes[step]", "del self.finishes[step]", "pass",
              "equivalent: an emptied entry stays as []; join appends to it and postprocess pops it at its clock, "
              "where [] and None both mean nobody finishes"),
    *(Explained("optimized/scheduler.py", "self._last_batch = None", "self._last_batch = None", "pass",
                "equivalent: postprocess's fast path also needs group.inflight, which only the decode that "
                "set _last_batch turns on, and postprocess or dissolve turn off", previous=before)
      for before in ("if self._waiting:", "self._postprocess_each(seqs, token_ids, is_prefill)")),
    Explained("optimized/free_queue.py", "self.stale -= 1", "self.stale -= 1", "self.stale += 1",
              "equivalent: stale > 0 only sends take() down its checking path, which returns the same ids"),
    Explained("optimized/kv_cache_manager.py",
              "return self.hashes.get(h, cached + 1) <= cached or self.blocks.get(block_id, cached + 1) <= cached",
              "1", "2", "equivalent: any default above ``cached`` gives the same answer"),
    *(Explained("optimized/kv_cache_manager.py", text, text, "pass",
                "dead code: nothing reads KVCacheManager.blocks (the optimized Scheduler's snapshot() builds "
                "its state itself); the core split should drop the property")
      for text in ("block = Block(b)", "block.ref_count = refs[b]", "block.hash = self.block_hash(b)",
                   "block.token_ids = self.token_ids_of(b)", "out.append(block)", "out = []",
                   "refs = self.ref_counts")),
    Explained("optimized/scheduler.py", "if len(members) < k:", "len(members) < k", "(len(members) <= k)",
              "equivalent: joining an empty slice of running changes nothing"),
    Explained("optimized/scheduler.py", "break", "break", "continue",
              "equivalent: due is in member order, so once j >= t every later member has j >= t too",
              previous="if j >= t:"),
    Explained("optimized/scheduler.py", "break", "break", "continue",
              "equivalent: after a preemption in _decode_with_preemption t <= j, so the next due member "
              "(later in member order) meets j >= t and the loop ends anyway", previous="continue"),
    Explained("optimized/sequence.py", "self.sampling_params = sampling_params",
              "self.sampling_params = sampling_params", "pass",
              "dead code: Sequence.sampling_params is read nowhere (the fields are copied out in __init__)"),
    Explained("optimized/sequence.py", "self.region_capacity = 0", "self.region_capacity = 0", "pass",
              "equivalent: TokenArena.place sets it when the scheduler adds the sequence, before any read"),
    Explained("optimized/sequence.py", "self.region_capacity = 0", "0", "1",
              "equivalent: TokenArena.place sets it when the scheduler adds the sequence, before any read"),
    Explained("optimized/sequence.py", "self._gord = 0", "self._gord = 0", "pass",
              "equivalent: DecodeGroup.join sets it before any read"),
    Explained("optimized/token_arena.py", "def __init__(self, on_move: Callable[[], None], capacity: int = 1 << 16) "
              "-> None:", "1", "2", EQUIVALENT_ARENA_SIZE),
    Explained("optimized/token_arena.py", "def __init__(self, on_move: Callable[[], None], capacity: int = 1 << 16) "
              "-> None:", "16", "17", EQUIVALENT_ARENA_SIZE),
    Explained("optimized/token_arena.py", "self.dead += owner.region_capacity", "self.dead += owner.region_capacity",
              "pass", EQUIVALENT_ARENA_SIZE + " (dead space counted as live makes it bigger)"),
    Explained("optimized/token_arena.py", "while size < 2 * (live + capacity):", "2", "3", EQUIVALENT_ARENA_SIZE),
    Explained("optimized/token_arena.py", "size *= 2", "2", "3", EQUIVALENT_ARENA_SIZE),
    Explained("optimized/token_arena.py", "top = 0", "0", "1",
              "equivalent: packing leaves the first slot unused; every read goes through region_offset"),
)


def explanation(mutant: Mutant, lines: list[str], entries: tuple[Explained, ...] = EXPLAINED) -> str:
    """The reason ``mutant`` (of the file whose lines are ``lines``) may survive, or "" when it is not explained."""
    text = lines[mutant.line - 1].strip()
    previous = lines[mutant.line - 2].strip() if mutant.line > 1 else ""
    for entry in entries:
        if (entry.path, entry.line, entry.before, entry.after) == (mutant.path, text, mutant.before, mutant.after) \
                and entry.previous in ("", previous):
            return entry.why
    return ""
