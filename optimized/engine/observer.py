"""``StepObserver``: what the engine tells whoever watches it (check mode's shadow, the trace's recorder).

Invariant: an observer sees every change of the engine's state, in the order the
engine makes them, and nothing else: an add, a step's decisions, the step's
outcome (ran or failed), an abort. The engine knows observers only through this
protocol; the entry floor (optimized/entry/) chooses and wires them, so the
engine imports neither verify/ nor trace/ (spec/architecture.md, ARCH-3).

A hook that raises inside a change leaves the engine untrusted (ENG-11), except
``step_failed``, which must not raise (FAULT-5: the model's fault is what
propagates). ``before_change`` and ``check_add`` run before a change begins, so
a refusal there changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from optimized.core.scheduler import ScheduleOutput, Scheduler
    from optimized.engine.engine import Request
    from optimized.engine.sampling_params import SamplingParams


class StepObserver(Protocol):
    def before_change(self) -> None:
        """Raise to refuse any change (a closed or broken trace), before it begins."""

    def check_add(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError to refuse a request this observer could not take (ENG-10); changes nothing."""

    def added(self, request: Request) -> None:
        """``request`` was queued (inside the add)."""

    def scheduled(self, scheduler: Scheduler, out: ScheduleOutput[Any], requests: Sequence[Request],
                  live: Mapping[int, Request]) -> None:
        """``schedule()`` decided ``out``; ``requests`` are its batch's, ``live`` every live one by seq_id."""

    def stepped(self, scheduler: Scheduler, tokens: Any, finished: Sequence[Request], start: float) -> None:
        """The step's model run gave ``tokens``; postprocess finished ``finished``. ``start``: the run's start."""

    def step_failed(self, fault: BaseException, start: float) -> None:
        """The step's model run raised ``fault`` (FAULT-1), before its batch is withdrawn. Never raises."""

    def batch_withdrawn(self, scheduler: Scheduler, failed: Sequence[Request], live: Mapping[int, Request]) -> None:
        """FAULT-2: the failed step's batch ``failed`` was withdrawn and aborted."""

    def aborted(self, scheduler: Scheduler, request: Request, live: Mapping[int, Request]) -> None:
        """ABORT-8: ``request`` was aborted between steps (it is no longer in ``live``)."""

    def close(self) -> None:
        """The engine is done: flush what is kept."""
