"""A broken invariant, named by the spec clause it breaks.

A ``Violation`` is a value: frozen, comparable, and printable. Its ``clause``
is an id of spec/invariants.md (``INV-<n>``); its ``message`` says which block
or sequence broke it, so a failing replay points at the culprit directly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Violation:
    clause: str
    message: str

    def __str__(self) -> str:
        return f"{self.clause}: {self.message}"
