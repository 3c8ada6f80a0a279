"""The failure rule both hypothesis machines share: a client hangs up, or the model raises in the middle of a step.

Invariant: one rule draws both (``fault``), so failures stay rarer than
arrivals and steps and runs still reach full caches; a machine says what
"busy" means and how it aborts a request and fails a step, each through the
scheduler port (spec/abort.md, ABORT-1..6, FAULT-2). Hypothesis orders rules
by name, so a machine that inherits the rule draws exactly what one that
defined it itself drew.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from optimized.verify.machines import Stats


class FailureRule(RuleBasedStateMachine):
    stats: Stats

    def busy(self) -> bool:
        """Whether a request is waiting or running (the rule's precondition)."""
        raise NotImplementedError

    def a_request_is_aborted(self, data: st.DataObject) -> None:
        """ABORT-1..3: a live request (drawn from ``data``) leaves wherever it is."""
        raise NotImplementedError

    def a_step_fails(self) -> None:
        """FAULT-2: schedule(), then the batch is withdrawn and aborted instead of postprocessed."""
        raise NotImplementedError

    def may_fail(self) -> bool:
        """Whether this run lets things go wrong at all (a swarm may leave the rule out)."""
        return True

    @precondition(lambda self: self.busy() and self.may_fail())
    @rule(data=st.data(), fault=st.booleans())
    def something_goes_wrong(self, data: st.DataObject, fault: bool) -> None:
        """Beyond the lesson (spec/abort.md): a client hangs up, or the model raises in the middle of a step."""
        self.stats.rule_applications += 1
        if fault:
            self.a_step_fails()
        else:
            self.a_request_is_aborted(data)
