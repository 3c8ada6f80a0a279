"""Run the Triton kernel tests on the device named by NANOVERIFY_KERNEL_DEVICE: the CPU (default) or CUDA.

On the CPU (``cpu``, the default) every Triton kernel runs through the Triton interpreter. Triton 3.x decides
interpreted-vs-compiled when ``@triton.jit`` runs — for its own standard library (``tl.max``, ``tl.sum``...) when
``triton`` is first imported, for our kernels when ``kernels.triton_*`` is imported — so TRITON_INTERPRET must be set
before triton is imported anywhere in the process (transformers' modeling code imports it too). This conftest sets it
when pytest collects tests/kernels, which in a plain ``pytest`` run precedes every other test module (and
tests/conftest.py sets it even earlier). On CUDA (``cuda``, as gpu-check's kernels stage runs them) the interpreter
is left off and the tests place every tensor a kernel or its torch twin sees on the GPU. The session fails loudly,
before any test runs, whenever the run would not be what it claims to be: on the CPU with triton already compiled
(interpreted kernels cannot call its compiled standard library), and on CUDA with triton interpreted (that would be
a CPU result reported as a GPU one) or with no CUDA device at all.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

if os.environ.get("NANOVERIFY_KERNEL_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # after the environment variable, on purpose (so is everything below)
import triton.language.standard
from triton.runtime.jit import JITFunction  # the compiled kind; interpreted kernels are not JITFunctions

KERNEL_DEVICE = os.environ.get("NANOVERIFY_KERNEL_DEVICE", "cpu")
TRITON_COMPILED = isinstance(triton.language.standard.max, JITFunction)


def kernel_device_problem(kernel_device: str, triton_compiled: bool, cuda_available: bool) -> str | None:
    """Why the kernel tests cannot honestly run on ``kernel_device``, or None when they can."""
    if kernel_device == "cpu":
        if triton_compiled:
            return (
                "triton was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1, so its kernels are "
                "compiled and cannot run on the CPU; run with TRITON_INTERPRET=1 in the environment"
            )
        return None
    if kernel_device == "cuda":
        if not triton_compiled:
            return (
                "NANOVERIFY_KERNEL_DEVICE=cuda but triton is interpreted (TRITON_INTERPRET="
                f"{os.environ.get('TRITON_INTERPRET', '')!r}), which would not be a GPU result; "
                "run with TRITON_INTERPRET=0"
            )
        if not cuda_available:
            return "NANOVERIFY_KERNEL_DEVICE=cuda but torch.cuda.is_available() is False: no CUDA device to test on"
        return None
    return f"NANOVERIFY_KERNEL_DEVICE must be 'cpu' or 'cuda', got {kernel_device!r}"


@pytest.fixture(autouse=True, scope="session")
def triton_mode_matches_kernel_device() -> Iterator[None]:
    problem = kernel_device_problem(KERNEL_DEVICE, TRITON_COMPILED, torch.cuda.is_available())
    if problem is not None:
        pytest.fail(problem)
    yield


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device every Triton kernel under test, and the torch implementation it is compared with, runs on."""
    return torch.device(KERNEL_DEVICE)
