"""Compile ``cpu_attention.c`` once per machine into a cache folder and load it with ctypes.

Invariants: the library lives in ``$NANOVERIFY_CACHE`` (or ``~/.cache/nanoverify``, the default model's root)
``/kernels/cpu_attention-<key>.so``, where the key hashes the C source, the compiler's path, the flags and the
machine (its architecture and the CPU model and feature flags of ``/proc/cpuinfo``, because ``-march=native`` makes
code for this CPU only). A build writes a temporary file beside its final name and renames it into place, so a
concurrent process sees either no library or a whole one, and a present library is loaded without running the
compiler. When no C compiler is found or the build fails, ``load_library`` raises ``CpuKernelUnavailable`` whose
message says why (the compiler's own error included); it never returns a half-built library. Torch is imported
before the library is loaded so that, where torch's build provides its OpenMP runtime as ``libgomp.so.1`` (this
wheel ships ``torch/lib/libgomp.so.1``, the soname of the GCC runtime the library links against), the loader binds
the library to that already loaded copy: one thread pool, not two. A torch bundling its runtime under another name
would leave two runtimes mapped; a test (KERN-25) checks that exactly one is. The result, library or reason, is
computed once per process.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (first, so that libgomp.so.1 is torch's where it ships one; see the module docstring)

SOURCE = Path(__file__).with_name("cpu_attention.c")
# IEEE semantics on purpose (no -ffast-math), and no contraction of a * b + c into one fused multiply-add: the
# kernel rounds where its source says.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11")
COMPILERS = ("cc", "gcc")
BUILD_TIMEOUT_S = 120


class CpuKernelUnavailable(RuntimeError):
    """The compiled CPU kernel cannot be had on this machine; the message says why."""


def find_compiler() -> str | None:
    """The first C compiler on the PATH, or None."""
    for name in COMPILERS:
        path = shutil.which(name)
        if path is not None:
            return path
    return None


def cache_dir() -> Path:
    env = os.environ.get("NANOVERIFY_CACHE")
    root = Path(env) if env else Path.home() / ".cache" / "nanoverify"
    return root / "kernels"


def machine_id() -> str:
    """What ``-march=native`` depends on: the architecture, the CPU model and its feature flags."""
    lines = [platform.machine()]
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "\n".join([*lines, platform.processor()])
    for key in ("vendor_id", "cpu family", "model", "model name", "flags"):
        found = next((ln for ln in text.splitlines() if ln.split(":")[0].strip() == key), "")
        lines.append(found)
    return "\n".join(lines)


def library_path(compiler: str, source: Path = SOURCE) -> Path:
    digest = hashlib.sha256()
    for part in (source.read_bytes(), os.path.realpath(compiler).encode(), " ".join(FLAGS).encode()):
        digest.update(part)
        digest.update(b"\0")
    digest.update(machine_id().encode())
    return cache_dir() / f"{source.stem}-{digest.hexdigest()[:20]}.so"


def build(compiler: str, source: Path, target: Path) -> None:
    """Compile ``source`` into ``target``, atomically."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".so", dir=target.parent)
    except OSError as e:
        raise CpuKernelUnavailable(f"cannot write the kernel cache folder {target.parent}: {e}") from None
    os.close(fd)
    try:
        cmd = [compiler, *FLAGS, "-o", tmp, str(source.resolve())]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise CpuKernelUnavailable(f"compiling {source.name} with {compiler} failed: {e}") from None
        if done.returncode != 0:
            error = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise CpuKernelUnavailable(
                f"compiling {source.name} with {compiler} failed (exit {done.returncode}): " + " | ".join(error)
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(compiler: str) -> ctypes.CDLL:
    target = library_path(compiler)
    cached = target.is_file()
    if not cached:
        build(compiler, SOURCE, target)
    try:
        return ctypes.CDLL(str(target))
    except OSError as e:
        if not cached:
            raise CpuKernelUnavailable(f"loading {target} failed: {e}") from None
    # A damaged cached library (say, truncated by a full disk) is rebuilt once.
    build(compiler, SOURCE, target)
    try:
        return ctypes.CDLL(str(target))
    except OSError as e:
        raise CpuKernelUnavailable(f"loading {target} failed: {e}") from None


@functools.cache
def _outcome() -> ctypes.CDLL | str:
    compiler = find_compiler()
    if compiler is None:
        return f"no C compiler on the PATH (looked for {', '.join(COMPILERS)})"
    try:
        return _load(compiler)
    except CpuKernelUnavailable as e:
        return str(e)
    except OSError as e:  # reading the source, renaming the build into place
        return f"building the CPU kernels failed: {e}"


def load_library() -> ctypes.CDLL:
    """The compiled kernel library, built first if this machine has none cached (once per process: a failure is
    remembered too)."""
    outcome = _outcome()
    if isinstance(outcome, str):
        raise CpuKernelUnavailable(outcome)
    return outcome


def unavailable_reason() -> str | None:
    """Why the compiled CPU kernel cannot be used here, or None when it loads."""
    outcome = _outcome()
    return outcome if isinstance(outcome, str) else None


def forget() -> None:
    """Drop this process's remembered outcome, so the next load looks again (for tests)."""
    _outcome.cache_clear()
