"""A worker's parent watchdog (TP-3): the process exits as soon as the process that started it is gone.

Invariant: a process that called ``watch_parent(p)`` while ``p`` was its parent exits (status 1) within about
``POLL_SECONDS`` of ``p`` dying, however it died (SIGKILL included): the orphan is re-parented, ``os.getppid()``
changes, and a daemon thread notices, removing first what the parent would have removed (its private store's
folder). No sockets, no signals asked of the parent. This module imports nothing but the standard library, so a
test can run it in a bare interpreter.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

POLL_SECONDS = 0.2


def watch_parent(parent: int, leftover: str | None = None) -> threading.Thread:
    """Start the watchdog thread for ``parent``; the thread (a daemon). ``leftover``: a folder to remove when the
    parent is gone."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_SECONDS)
        if leftover is not None:
            shutil.rmtree(leftover, ignore_errors=True)
        os._exit(1)

    thread = threading.Thread(target=watch, name="nanoverify-parent-watchdog", daemon=True)
    thread.start()
    return thread
