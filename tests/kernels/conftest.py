"""Run every Triton kernel in these tests on the CPU through the Triton interpreter.

Triton 3.x decides interpreted-vs-compiled when ``@triton.jit`` runs — for its own standard library (``tl.max``,
``tl.sum``...) when ``triton`` is first imported, for our kernels when ``kernels.triton_*`` is imported — so
TRITON_INTERPRET must be set before triton is imported anywhere in the process (transformers' modeling code imports
it too). This conftest sets it when pytest collects tests/kernels, which in a plain ``pytest`` run precedes every
other test module. If triton was nevertheless imported compiled (another test module collected first), interpreted
kernels cannot call its compiled standard library, so the tests fail loudly with that explanation rather than
with an obscure interpreter error; set TRITON_INTERPRET=1 in the environment to run them in any order.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ["TRITON_INTERPRET"] = "1"

import triton.language.standard  # after the environment variable, on purpose
from triton.runtime.jit import JITFunction  # the compiled kind; interpreted kernels are not JITFunctions

TRITON_COMPILED = isinstance(triton.language.standard.max, JITFunction)


@pytest.fixture(autouse=True, scope="session")
def triton_interpreter() -> Iterator[None]:
    if TRITON_COMPILED:
        pytest.fail(
            "triton was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1, so its kernels are "
            "compiled and cannot run on the CPU; run with TRITON_INTERPRET=1 in the environment"
        )
    yield
