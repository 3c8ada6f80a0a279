"""Run every Triton kernel in these tests on the CPU through the Triton interpreter.

Triton 3.x decides interpreted-vs-compiled when ``@triton.jit`` runs, i.e. when a kernel module is imported, so
TRITON_INTERPRET must be set before any ``kernels.triton_*`` import. This conftest sets it at collection time; if a
kernel module was nevertheless imported earlier in the same process without it (another test file), the autouse
fixture reloads those modules so their kernels are rebuilt as interpreted functions. Tests must reach kernels through
module attributes (``triton_decode.paged_decode``), never names bound at import, so a reload takes effect.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator

import pytest

os.environ["TRITON_INTERPRET"] = "1"

# Dependency order: helpers first, so modules importing from them rebind to the reloaded objects.
TRITON_MODULES = (
    "kernels.triton_round",
    "kernels.triton_store",
    "kernels.triton_decode",
    "kernels.triton_prefill",
    "kernels.triton_norm",
    "kernels.triton_rotary",
    "kernels.triton_sampling",
    "kernels.triton_backend",
)


def _compiled_kernels_loaded() -> bool:
    from triton.runtime.jit import JITFunction  # the compiled kind; interpreted kernels are not JITFunctions

    for name in TRITON_MODULES:
        module = sys.modules.get(name)
        if module is None:
            continue
        for value in vars(module).values():
            if isinstance(value, JITFunction):
                return True
    return False


@pytest.fixture(autouse=True, scope="session")
def triton_interpreter() -> Iterator[None]:
    os.environ["TRITON_INTERPRET"] = "1"
    if _compiled_kernels_loaded():
        for name in TRITON_MODULES:
            importlib.reload(importlib.import_module(name))
    assert not _compiled_kernels_loaded()
    yield
