"""``nanoverify serve``: an OpenAI-compatible HTTP server over one ``LLM`` (spec/serve.md).

Importing this package imports nothing heavy: ``detokenizer`` is used by the
``LLM`` itself (stop strings), the server modules import FastAPI when loaded.
"""
