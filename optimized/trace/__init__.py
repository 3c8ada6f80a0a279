"""Record, replay, draw (spec/trace.md): a run written down as it happens, judged afterwards by the reference.

Invariant: a trace holds everything a scheduler's decisions depend on (the
configuration, each arrival and abort before the step it preceded, each step's
tokens, stop cuts and failures), so replaying it through either scheduler must
reproduce every recorded decision. ``recorder`` writes, ``schema`` reads and
validates, ``replay`` compares, ``workload`` records a conformance workload
through the reference, ``timeline`` draws.
"""
