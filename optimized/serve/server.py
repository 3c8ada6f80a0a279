"""Running the app under uvicorn, with nanoverify's shutdown (SERVE-8).

Invariant: the first SIGTERM or SIGINT stops admission at once (``/health``
and new ``/v1`` requests answer 503) while requests in flight go on; when the
last one has finished, or ``shutdown_timeout`` seconds have passed and the
engine loop has aborted what was left and delivered their ends (their streams
end with finish_reason "abort"), uvicorn is told to exit. The process exits 0,
or ``EXIT_ENGINE_LOST`` when the engine was lost on the way (SERVE-20). A
second signal aborts at once. uvicorn re-raises a signal it captured after its
own graceful exit, which would end the process by that signal: ``handle_exit``
is overridden so it never records one. The listening socket is bound before
the model loads (``listening_socket``), so a busy port costs no load (SERVE-23).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from types import FrameType

import uvicorn

from optimized.serve.app import Lifecycle, ServerOptions, build_app
from optimized.serve.chat import load_chat_template
from optimized.serve.loop import EngineHandle, EngineInfo
from optimized.serve.metrics import Metrics

SETTLE_SECONDS = 2  # after the engine is idle: for handlers to send their last bytes
ABORT_SECONDS = 10  # SERVE-8: for the engine to deliver the aborted requests' ends after the grace period
EXIT_ENGINE_LOST = 3  # SERVE-20: serve's exit status after the engine was lost (died, stalled away, untrusted)
log = logging.getLogger("nanoverify.serve")


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` (not yet listening: uvicorn listens on it once the model is loaded), or
    an OSError naming both (SERVE-23)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise OSError(f"could not listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a restart reuses the port
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise OSError(f"could not listen on {host}:{port}: {e.strerror or e}") from None
    return sock


class NanoverifyServer(uvicorn.Server):
    """uvicorn's server with a draining shutdown and a line saying where it listens once it does."""

    def __init__(self, config: uvicorn.Config, loop: EngineHandle, life: Lifecycle, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine_loop = loop
        self.life = life
        self.shutdown_timeout = shutdown_timeout
        self.bound: tuple[str, int] | None = None
        self.drainer: threading.Thread | None = None  # the thread that waits for the in-flight requests

    async def startup(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        await super().startup(sockets)  # type: ignore[arg-type]
        if self.started and getattr(self, "servers", None):
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.bound = (str(host), int(port))
            print(f"nanoverify serve: listening on http://{host}:{port}", flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.life.draining:  # a second signal: abort what is left and exit now
            self.engine_loop.abort_all()
            self.should_exit = True
            return
        self.begin_drain()

    def begin_drain(self) -> None:
        """SERVE-8: stop admitting, let the in-flight requests finish (or abort them at the deadline), then exit."""
        self.life.draining = True
        self.engine_loop.close()
        self.drainer = threading.Thread(target=self._drain, name="nanoverify-drain", daemon=True)
        self.drainer.start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        while self.engine_loop.in_flight() and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.engine_loop.in_flight():
            log.warning("shutdown: %d requests still running after %.1f s are aborted", self.engine_loop.in_flight(),
                        self.shutdown_timeout)
            self.engine_loop.abort_all()
            # The aborts cost what they cost (a step to finish first, check mode's mirror of each): their ends are
            # awaited, not a fixed settle time, so no stream is cut off before its abort chunk.
            aborted = time.monotonic() + ABORT_SECONDS
            while self.engine_loop.in_flight() and time.monotonic() < aborted:
                time.sleep(0.02)
            if self.engine_loop.in_flight():  # a hung engine: stopped (killed if need be), its streams failed
                log.warning("shutdown: the engine did not end %d aborted requests within %d s",
                            self.engine_loop.in_flight(), ABORT_SECONDS)
                self.engine_loop.stop()
        settle = time.monotonic() + SETTLE_SECONDS
        while self.life.handlers and time.monotonic() < settle:
            time.sleep(0.02)
        self.should_exit = True


def serve(loop: EngineHandle, info: EngineInfo, metrics: Metrics, sock: socket.socket, options: ServerOptions,
          shutdown_timeout: float) -> int:
    """Serve the engine behind ``loop`` (``info`` describes it, ``metrics`` is what it reports to) on ``sock``
    (``listening_socket``'s) until a signal ends it; the exit status: 0 after a clean shutdown, EXIT_ENGINE_LOST
    when the engine was lost. The loop is stopped before this returns."""
    host, port = sock.getsockname()[:2]
    started = False
    try:  # the socket is closed and the loop stopped however this ends (a bad chat template too)
        life = Lifecycle()
        app = build_app(info, loop, metrics, load_chat_template(info.model_dir), options, life)
        config = uvicorn.Config(app, host=host, port=port, http="httptools", log_level="warning", access_log=False,
                                lifespan="on", timeout_graceful_shutdown=SETTLE_SECONDS, server_header=False)
        server = NanoverifyServer(config, loop, life, shutdown_timeout)
        server.run(sockets=[sock])
        started = server.started
    except SystemExit:  # uvicorn's way of saying it could not start
        pass
    finally:
        loop.stop()
        sock.close()
    if not started:
        raise OSError(f"could not listen on {host}:{port} (see the log above)")
    if loop.failure is not None:
        log.error("serve exits with status %d: the engine was lost (%s)", EXIT_ENGINE_LOST, loop.failure)
        return EXIT_ENGINE_LOST
    return 0
