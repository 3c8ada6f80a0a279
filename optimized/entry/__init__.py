"""The entry floor: ``LLM``, which wires the engine to its plug-ins (check mode, the trace, tensor parallelism).

It sits above engine/ and the plug-in rooms and below serve/, cli/ and benchmarks/ (spec/architecture.md), as
vLLM's entrypoints sit above its engine.
"""
