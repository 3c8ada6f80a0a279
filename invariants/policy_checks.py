"""The policies' own state invariants (spec/policies.md), each applied only under its policy.

Each predicate returns the violations it finds, named by the policy's clause: POLICY-2 (``mixed``: no more running
sequences than the budget has tokens), POLICY-6 (``priority``: both queues in (priority, arrival) order past a
prefill cut short) and POLICY-10 (``lpm``: no waiting request passed over more than ``patience`` times). Under any
other policy each returns nothing. They read no block, and hold between steps and right after schedule().
"""

from __future__ import annotations

import itertools

from invariants.state import SchedulerState, SeqView
from invariants.violation import Violation


def check_policy(state: SchedulerState) -> list[Violation]:
    """Every policy clause that applies to ``state.policy``."""
    return [*check_running_bound(state), *check_priority_order(state), *check_starvation_bound(state)]


def check_running_bound(state: SchedulerState) -> list[Violation]:
    """POLICY-2 (``mixed``): ``running`` holds at most ``max_num_batched_tokens`` sequences, so the decodes of a
    step fit its budget."""
    if state.policy != "mixed" or len(state.running) <= state.max_num_batched_tokens:
        return []
    return [Violation("POLICY-2", f"{len(state.running)} sequences are running, more than the budget's "
                                  f"{state.max_num_batched_tokens} tokens")]


def ordered_waiting(state: SchedulerState) -> list[SeqView]:
    """The waiting sequences a policy keeps in order: all but a prefill cut short at the front (it holds blocks)."""
    waiting = state.waiting
    return waiting[1:] if waiting and waiting[0].block_table else waiting


def check_priority_order(state: SchedulerState) -> list[Violation]:
    """POLICY-6 (``priority``): ``running``, and ``waiting`` past a prefill cut short, are strictly increasing in
    (priority, seq_id); every live sequence has a priority."""
    if state.policy != "priority":
        return []
    priorities = state.priorities
    missing = [s.seq_id for s in (*state.running, *state.waiting) if s.seq_id not in priorities]
    if missing:
        return [Violation("POLICY-6", f"live seqs {missing} have no priority")]
    found: list[Violation] = []
    for name, queue in (("running", state.running), ("waiting", ordered_waiting(state))):
        keys = [(priorities[s.seq_id], s.seq_id) for s in queue]
        for before, after in itertools.pairwise(keys):
            if before >= after:
                found.append(Violation("POLICY-6", f"{name} holds (priority, seq_id) {before} before {after}"))
                break
    return found


def check_starvation_bound(state: SchedulerState) -> list[Violation]:
    """POLICY-10 (``lpm``): no waiting request has been passed over more than ``patience`` times (nor a negative
    number). A waiting request whose count the state does not carry is not judged (a light state, CHECK-2, may carry
    none; a snapshot carries every waiting request's)."""
    if state.policy != "lpm":
        return []
    found: list[Violation] = []
    for seq in state.waiting:
        count = state.passes.get(seq.seq_id)
        if count is not None and not 0 <= count <= state.patience:
            found.append(Violation("POLICY-10", f"waiting seq {seq.seq_id} was passed over {count} times, "
                                                f"patience is {state.patience}"))
    return found
