"""``nanoverify serve``: an OpenAI-compatible HTTP server over one ``LLM`` (spec/serve.md).

Importing this package imports nothing heavy: the server modules import FastAPI
when loaded. The incremental detokenizer the server streams text through lives
in optimized/engine/detokenizer.py, since the ``LLM`` uses it too (stop strings).
"""
