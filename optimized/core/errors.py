"""Typed errors of the engine and the optimized scheduler."""

from __future__ import annotations


class EmptyDecodeError(RuntimeError):
    """schedule() found nothing to run although sequences were waiting or running.

    The reference's ``assert scheduled_seqs`` fires at the same step (spec EDGE-2).
    """


class WorkloadError(ValueError):
    """A conformance workload is malformed; the message names the field."""
