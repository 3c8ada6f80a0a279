"""Survivors already explained: equivalent mutants and dead code, left out of the score with their reason (MUT-6).

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


EQUIVALENT_ARENA_SIZE = ("equivalent: only how big the token array is, never which tokens a region holds, and it stays "
                         "within OPT-12's bound (four times the live regions or the initial size)")
ARENA_INIT = "def __init__(self, on_move: Callable[[], None], capacity: int = 1 << 16) -> None:"

EQUIVALENT_SHARED = ("equivalent: _shared > 0 only sends release() down its counting path, which frees the same ids; "
                     "a count too large costs time only")

EXPLAINED: tuple[Explained, ...] = (
    Explained("reference/extensions.py",
              "kept = not is_prefill or seq.num_cached_tokens + seq.num_scheduled_tokens >= seq.num_tokens",
              "not is_prefill", "(is_prefill)",
              "equivalent: in a decode step the other operand holds anyway (cached + scheduled == tokens), and a "
              "sequence mid-chunk is still WAITING, so the RUNNING check skips it whatever kept says. This needs each "
              "postprocess to follow exactly one schedule() (a second one has scheduled == 0): the port refuses any "
              "other postprocess (OPT-23), and only the port calls this"),
    Explained("reference/mixed_scheduler.py",
              "while self.running and len(scheduled) < self.max_num_seqs:  # never more running than the budget: "
              "below",
              "len(scheduled) < self.max_num_seqs", "(len(scheduled) <= self.max_num_seqs)",
              "equivalent: running never holds more than max_num_seqs (it starts empty; a step that preempted admits "
              "nothing, else the decodes are all of running and the prefill adds at most max_num_seqs minus them), "
              "and each turn of the loop moves one sequence out of running, so len(scheduled) < max_num_seqs holds "
              "whenever running is not empty: the bound never stops the loop"),
    Explained("reference/mixed_scheduler.py",
              "break  # the budget is spent: this one stays at the front of waiting, partly prefilled", "break",
              "continue", "equivalent: a chunk is cut short only when it took the whole budget (min(num_tokens, "
              "budget) == budget), so budget is 0 and the loop's own condition ends it"),
    Explained("optimized/core/priority_scheduler.py", "if place < len(members):", "place < len(members)",
              "(place <= len(members))",
              "equivalent: at place == len(members) the loop settles members[place:], which is empty, and "
              "truncate(place) keeps every member and every position (positions has one entry per member)"),
    Explained("optimized/core/block_pool.py", "self._shared += sum(1 for b in hits if extra[b] == 1)", "1", "2",
              EQUIVALENT_SHARED + " (the same edit of ``extra[b] == 1`` undercounts and is killed)"),
    Explained("optimized/core/block_pool.py", "self._shared += 1", "1", "2", EQUIVALENT_SHARED),
    Explained("optimized/core/block_pool.py",
              "self._shared -= counts.count(1)  # those that had one other holder are now its alone",
              "self._shared -= counts.count(1)", "pass", EQUIVALENT_SHARED),
    Explained("optimized/core/block_pool.py",
              "counts = itemgetter(*table)(extra) if len(table) > 1 else tuple(extra[b] for b in table)", "1", "2",
              "equivalent: for two ids the generator gives the same tuple of counts as itemgetter"),
    Explained("optimized/core/decode_group.py", "self.base_clock = 0", "0", "1",
              "equivalent: positions is empty until the first join, which sets base_clock"),
    Explained("optimized/core/decode_group.py", "self._next_gord += 1", "1", "2",
              "equivalent: only the order of the join ordinals is read"),
    Explained("optimized/core/decode_group.py", "core.segments.clear()", "core.segments.clear()", "pass",
              "equivalent: a deferred fill walks back from the newest segment, so stale older ones are never "
              "reached; clearing bounds memory only"),
    Explained("optimized/core/scheduler.py", "self._last_batch: list[Sequence] | None = None",
              "self._last_batch: list[Sequence] | None = None", "pass",
              "equivalent: the first value is never read: postprocess reads _last_batch only while a step awaits "
              "(_step_batch is not empty), and _awaiting, which alone sets _step_batch, assigns it first"),
    Explained("optimized/core/free_queue.py", "self.stale -= 1", "self.stale -= 1", "self.stale += 1",
              "equivalent: stale > 0 only sends take() down its checking path, which returns the same ids"),
    Explained("optimized/core/free_queue.py", "if k > 1024 and 2 * k > len(buf):", "k > 1024 and 2 * k > len(buf)",
              "(k > 1024 or 2 * k > len(buf))",
              "equivalent: trimming the taken front is right at any k (positions are absolute); the bound only "
              "amortises the memmove"),
    *(Explained("optimized/core/free_queue.py", "if k > 1024 and 2 * k > len(buf):", before, after,
                "equivalent: trimming the taken front is right at any k (positions are absolute); the bound only "
                "amortises the memmove")
      for before, after in (("1024", "1025"), ("2 * k > len(buf)", "(2 * k >= len(buf))"))),
    Explained("optimized/core/kv_cache_manager.py", "if i >= end:", "i >= end", "(i > end)",
              "equivalent: at i == end the rest of extend_chain hashes an empty run of blocks, which adds nothing"),
    Explained("optimized/core/kv_cache_manager.py", "looked = chain[: m + 1] if m < last else chain[:m]", "1", "2",
              "equivalent: a hash past the one that missed gets an index above cached, which reads() ignores"),
    Explained("optimized/core/kv_cache_manager.py", "if self._memo is not None and self._memo.seq is seq:",
              "self._memo.seq is seq", "(self._memo.seq is not seq)",
              "equivalent: the memo is a cache; dropping another sequence's walk only makes can_allocate walk "
              "again, and a walk kept for the aborted sequence is never asked for (it cannot be added again)"),
    Explained("optimized/core/kv_cache_manager.py",
              "self.pool.hold(hits, num_cached_blocks == memo.cached and memo.used == len(hits) == len(set(hits)))",
              "num_cached_blocks == memo.cached", "(num_cached_blocks != memo.cached)",
              "equivalent: the scheduler allocates every hit of the walk (num_cached_blocks is can_allocate's "
              "answer), where the edit only turns off hold's fast path, whose other path does the same"),
    Explained("optimized/core/scheduler.py", "if len(watched) <= 4:", "len(watched) <= 4", "(len(watched) < 4)",
              "equivalent: both branches compute the same mask (a few comparisons or np.isin) for any int64 stop "
              "ids, and add refuses every other id (OPT-10; np.isin could not hold 2**63); the bound picks the "
              "faster"),
    Explained("optimized/core/port.py",
              "def new_sequence(self, token_ids: list[int], max_tokens: int, ignore_eos: bool = False,", "False",
              "True", "equivalent: a default in the protocol's signature is never used; each implementation's own "
              "default applies"),
    Explained("optimized/core/walk_memo.py", "if index < self.cached:", "index < self.cached",
              "(index <= self.cached)",
              "equivalent: cutting at index == cached keeps every hit, and used already equals sum(held)"),
    Explained("optimized/core/walk_memo.py",
              "self._hashes = dict(zip(reversed(looked), range(len(looked) - 1, -1, -1), strict=True))",
              "True", "False", "equivalent: the two sequences zipped always have the same length"),
    Explained("optimized/core/walk_memo.py",
              "self._blocks = dict(zip(reversed(hits), range(len(hits) - 1, -1, -1), strict=True))",
              "True", "False", "equivalent: the two sequences zipped always have the same length"),
    Explained("optimized/core/walk_memo.py", "return self.hashes.get(h, self.cached + 1) <= self.cached",
              "self.cached + 1", "(self.cached - 1)",
              "equivalent: a default at or below cached makes reads() answer yes for anything, which only drops "
              "the memo more often (the next can_allocate walks again)"),
    Explained("optimized/core/walk_memo.py", "return self.hashes.get(h, self.cached + 1) <= self.cached",
              "1", "2", "equivalent: any default above ``cached`` gives the same answer"),
    Explained("optimized/core/scheduler.py", "if len(members) < k:", "len(members) < k", "(len(members) <= k)",
              "equivalent: joining an empty slice of running changes nothing"),
    Explained("optimized/core/scheduler.py", "break", "break", "continue",
              "equivalent: due is in member order, so once j >= t every later member has j >= t too",
              previous="if j >= t:"),
    Explained("optimized/core/scheduler.py", "break", "break", "continue",
              "equivalent: after a preemption in _decode_with_preemption t <= j, so the next due member "
              "(later in member order) meets j >= t and the loop ends anyway", previous="continue"),
    Explained("optimized/core/sequence.py", "self.region_capacity = 0", "self.region_capacity = 0", "pass",
              "equivalent: TokenArena.place sets it when the scheduler adds the sequence, before any read"),
    Explained("optimized/core/sequence.py", "self.region_capacity = 0", "0", "1",
              "equivalent: TokenArena.place sets it when the scheduler adds the sequence, before any read"),
    Explained("optimized/core/sequence.py", "self.gord = 0", "self.gord = 0", "pass",
              "equivalent: DecodeGroup.join sets it before any read"),
    *(Explained("optimized/core/token_arena.py", ARENA_INIT, before, after, EQUIVALENT_ARENA_SIZE)
      for before, after in (("1", "2"), ("16", "17"))),
    Explained("optimized/core/token_arena.py", "if self.top + capacity > self.data.shape[0]:",
              "self.top + capacity > self.data.shape[0]", "(self.top + capacity >= self.data.shape[0])",
              EQUIVALENT_ARENA_SIZE + " (a region that would end exactly at the array's end packs first)"),
    Explained("optimized/core/token_arena.py", "top = 0", "0", "1",
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
