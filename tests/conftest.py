"""Hypothesis profiles for the suite (``ci`` by default, ``fuzz`` with HYPOTHESIS_PROFILE=fuzz), and the
``engine_env`` fixture every engine test module uses.

The settings themselves live in optimized.verify.machines so that the installed
``nanoverify fuzz`` command uses exactly the same ones.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

# Triton decides at its first import whether it interprets kernels, and transformers
# imports it too: without a GPU the kernel tests need the interpreter from the start.
if os.environ.get("NANOVERIFY_KERNEL_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hypothesis import settings

from optimized.verify.machines import CI_SETTINGS, FUZZ_SETTINGS
from tests.engine_fixtures import one_thread, set_root

settings.register_profile("ci", **CI_SETTINGS)
settings.register_profile("fuzz", **FUZZ_SETTINGS)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module")
def engine_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The session's tiny checkpoints under a temporary folder, and torch on one thread for the module
    (a module asks for it with ``pytestmark = pytest.mark.usefixtures("engine_env")``)."""
    set_root(tmp_path_factory.mktemp("engine"))
    with one_thread():
        yield


@pytest.fixture(scope="module")
def serve_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A module's own cache folder and HOME (the default model is made there), torch on one thread: the served
    tests' (tests/test_serve*.py) and their spawned servers' shared home."""
    with pytest.MonkeyPatch.context() as mp, one_thread():
        root = tmp_path_factory.mktemp("nanoverify-cache")
        mp.setenv("NANOVERIFY_CACHE", str(root))
        mp.setenv("HOME", str(root))
        yield root
