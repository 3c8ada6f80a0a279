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
from typing import TYPE_CHECKING

from optimized.engine.arg_types import bounded_int, minutes, utf8_text
from optimized.engine.args import EngineArgs

if TYPE_CHECKING:
    from optimized.serve.app import ServerOptions

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
    p.add_argument("--served-model-name", type=served_model_name, nargs="+", default=None, metavar="NAME",
                   help="the names clients pass as 'model', the first in answers (default: the --model argument "
                        "as given and its folder's name; 'default' for the embedded model)")
    p.add_argument("--step-timeout", type=minutes, default=60.0, metavar="S",
                   help="/health is 503 while requests are in flight and the engine has not finished a step for "
                        "S seconds (0: never; default 60)")


def served_model_name(text: str) -> str:
    """A name a client can send: UTF-8 text, not blank."""
    name = utf8_text(text)
    if not name.strip():
        raise argparse.ArgumentTypeError("must not be blank")
    return name


def served_names(model: str | None, given: list[str] | None = None) -> tuple[str, ...]:
    """SERVE-22: the names clients may pass as ``model``, the first the one answers carry: ``--served-model-name``'s,
    else the ``--model`` argument as given and its folder's name, else "default" (the embedded model)."""
    if given:
        return tuple(dict.fromkeys(given))
    if model is None:
        return ("default",)
    return tuple(dict.fromkeys((model, Path(model).resolve().name)))


def api_key(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """SERVE-11: the key clients must send: ``--api-key``, else NANOVERIFY_API_KEY (unset or empty: none)."""
    source = "--api-key" if flag is not None else "NANOVERIFY_API_KEY"
    key = flag if flag is not None else environ.get("NANOVERIFY_API_KEY") or None
    if key is None:
        return None
    if not key.strip():
        raise ValueError(f"{source} must not be blank")
    if key != key.strip() or not (key.isascii() and key.isprintable()):  # a client could not send it as it is
        raise ValueError(f"{source} must be printable ASCII without surrounding whitespace")
    return key


def server_options(args: argparse.Namespace, environ: Mapping[str, str]) -> ServerOptions:
    """The HTTP side's options from ``serve``'s arguments: the served names (SERVE-22), the key (SERVE-11)."""
    from optimized.serve.app import ServerOptions

    names = served_names(args.model, args.served_model_name)
    return ServerOptions(served_model=names[0], other_names=names[1:], api_key=api_key(args.api_key, environ),
                         stream_interval=args.stream_interval)


def main(args: argparse.Namespace) -> int:
    import logging
    import sys

    from optimized.parallel.launch import torchrun_rank
    from optimized.serve.engine_process import EngineProcess
    from optimized.serve.metrics import Metrics
    from optimized.serve.server import listening_socket, serve

    engine_args = EngineArgs.from_cli_args(args)
    options = server_options(args, os.environ)
    kwargs = engine_args.as_kwargs()
    if torchrun_rank() not in (None, 0):  # a torchrun worker rank: the LLM serves rank 0, then ends the process
        from optimized import LLM  # (TP-2): it never returns

        LLM(**kwargs)
        return 0
    sock = listening_socket(args.host, args.port)  # SERVE-23: a busy port is refused before the model loads
    try:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        metrics = Metrics()
        engine = EngineProcess(kwargs, metrics, args.step_timeout)  # the LLM is built there; its refusals raise here
    except BaseException:
        sock.close()
        raise
    try:
        return serve(engine, engine.info, metrics, sock, options, args.shutdown_timeout)
    finally:
        engine.stop()  # the engine process closes its LLM: the trace flushed, tensor-parallel workers stopped
