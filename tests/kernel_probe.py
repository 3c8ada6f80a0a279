"""A pytest plugin (``-p tests.kernel_probe``) that records how the kernel tests really ran.

Invariants: it imports nothing at load time (importing triton here would decide compiled-versus-interpreted
before tests/kernels/conftest.py runs); at the end of the session it writes, to the file named by
``NANOVERIFY_PROBE_OUT``, the ``TRITON_INTERPRET`` the tests ended up with and whether triton's standard library
was compiled (a ``JITFunction``) or interpreted, so gpu-check cannot report an interpreted run as a GPU run.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def pytest_sessionfinish(session: object, exitstatus: int) -> None:
    out = os.environ.get("NANOVERIFY_PROBE_OUT")
    if not out:
        return
    compiled = False
    if "triton.language.standard" in sys.modules:
        from triton.language import standard
        from triton.runtime.jit import JITFunction

        compiled = isinstance(standard.max, JITFunction)
    seen = {"triton_interpret": os.environ.get("TRITON_INTERPRET", ""), "triton_compiled": compiled,
            "exitstatus": int(exitstatus)}
    Path(out).write_text(json.dumps(seen))
