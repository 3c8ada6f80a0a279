"""``nanoverify serve``: an OpenAI-compatible HTTP server over the engine (spec/serve.md).

Prints ``nanoverify serve: listening on http://HOST:PORT`` once it accepts
connections (``--port 0`` picks a free port). The API key comes from
``--api-key`` or ``NANOVERIFY_API_KEY``; without either, no key is asked.
FastAPI, uvicorn and torch are imported only in ``main``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path

from optimized.engine.arg_types import bounded_int, minutes
from optimized.engine.args import EngineArgs

HELP = "serve the model over HTTP with OpenAI's API (completions, chat, streaming, /health, /metrics)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=bounded_int(0, 65535), default=8000, help="port (0: a free one; default 8000)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or NANOVERIFY_API_KEY)")
    p.add_argument("--stream-interval", type=bounded_int(1), default=1, metavar="N",
                   help="stream a chunk once N tokens wait (the first at once; default 1: every step)")
    p.add_argument("--shutdown-timeout", type=minutes, default=10.0, metavar="S",
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT (default 10)")


def served_name(model: str | None) -> str:
    """The name clients pass as ``model``: "default" for the embedded model, else the folder's name."""
    return "default" if model is None else Path(model).resolve().name


def api_key(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """SERVE-10: the key clients must send: ``--api-key``, else NANOVERIFY_API_KEY (unset or empty: none)."""
    source = "--api-key" if flag is not None else "NANOVERIFY_API_KEY"
    key = flag if flag is not None else environ.get("NANOVERIFY_API_KEY") or None
    if key is None:
        return None
    if not key.strip():
        raise ValueError(f"{source} must not be blank")
    if key != key.strip() or not (key.isascii() and key.isprintable()):  # a client could not send it as it is
        raise ValueError(f"{source} must be printable ASCII without surrounding whitespace")
    return key


def main(args: argparse.Namespace) -> int:
    import logging
    import sys

    from optimized.parallel.launch import torchrun_rank
    from optimized.serve.app import ServerOptions
    from optimized.serve.engine_process import EngineProcess
    from optimized.serve.metrics import Metrics
    from optimized.serve.server import serve

    engine_args = EngineArgs.from_cli_args(args)
    key = api_key(args.api_key, os.environ)
    options = ServerOptions(served_model=served_name(args.model), api_key=key, stream_interval=args.stream_interval)
    kwargs = engine_args.as_kwargs()
    if torchrun_rank() not in (None, 0):  # a torchrun worker rank: the LLM serves rank 0, then ends the process
        from optimized import LLM  # (TP-6): it never returns

        LLM(**kwargs)
        return 0
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    metrics = Metrics()
    engine = EngineProcess(kwargs, metrics)  # the LLM is built there; its refusals are raised here
    try:
        return serve(engine, engine.info, metrics, args.host, args.port, options, args.shutdown_timeout)
    finally:
        engine.stop()  # the engine process closes its LLM: the trace flushed, tensor-parallel workers stopped
