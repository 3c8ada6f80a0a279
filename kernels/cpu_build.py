"""Compile ``cpu_attention.c`` and ``cpu_linear.c`` once per machine into one library in a cache folder and load it
with ctypes, checked first.

Invariants: the library lives in ``$NANOVERIFY_CACHE`` (or ``~/.cache/nanoverify``, the default model's root)
``/kernels/cpu_kernels-<key>.so``, where the key hashes the C sources (and the header ``cpu_linear.c`` includes), the
compiler's path, the flags and the machine (its architecture and the CPU model and feature flags of ``/proc/cpuinfo``,
because ``-march=native`` makes code for this CPU only). Beside it, ``<name>.sha256`` records its size and SHA-256. A
library is handed to the dynamic loader only when its bytes match that record, and through the descriptor they were read
from, so the loader maps exactly the checked bytes: a truncated library (which the loader would map and die on with
SIGBUS), a changed one, or one with no record is never loaded, but rebuilt (spec/caches.md, DISK-1 to DISK-3). A build
holds an exclusive lock beside the library (two processes finding it damaged compile once: the second rechecks after the
wait), writes a temporary ``.making-<pid>-*`` file renamed into place, then the record, also renamed into place; it
removes temporary files of builds whose process is gone. A checked library the loader still refuses is rebuilt once. A
whole library is loaded without the lock or the compiler. When no C compiler is found, the cache folder cannot be
written, or the build or the load fails, ``load_library`` raises ``CpuKernelUnavailable`` whose message says why (the
compiler's own error included); it never returns a half-built library. Torch is imported before the library is loaded so
that, where torch's build provides its OpenMP runtime as ``libgomp.so.1`` (this wheel ships ``torch/lib/libgomp.so.1``,
the soname of the GCC runtime the library links against), the loader binds the library to that already loaded copy: one
thread pool, not two. A torch bundling its runtime under another name would leave two runtimes mapped; a test (KERN-25)
checks that exactly one is. The result, library or reason, is computed once per process. """

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch  # noqa: F401  (first, so that libgomp.so.1 is torch's where it ships one; see the module docstring)

from kernels import disk_cache

SOURCE = Path(__file__).with_name("cpu_attention.c")
LINEAR_SOURCE = Path(__file__).with_name("cpu_linear.c")
HEADERS = (Path(__file__).with_name("cpu_linear_tile.h"),)  # included by cpu_linear.c: part of the library's key
LIBRARY_STEM = "cpu_kernels"
# IEEE semantics on purpose (no -ffast-math), and no contraction of a * b + c into one fused multiply-add: the
# kernel rounds where its source says.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11")
LIBS = ("-lm",)  # fmaf, for cpu_linear.c's portable path
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


def sources() -> tuple[Path, ...]:
    """The C files compiled into the one library (read at call time, so a test may point ``SOURCE`` elsewhere)."""
    return (SOURCE, LINEAR_SOURCE)


def library_path(compiler: str) -> Path:
    digest = hashlib.sha256()
    parts = [*(source.read_bytes() for source in (*sources(), *HEADERS)), os.path.realpath(compiler).encode()]
    for part in (*parts, " ".join((*FLAGS, *LIBS)).encode()):
        digest.update(part)
        digest.update(b"\0")
    digest.update(machine_id().encode())
    return cache_dir() / f"{LIBRARY_STEM}-{digest.hexdigest()[:20]}.so"


def sidecar_path(target: Path) -> Path:
    """The file recording the size and SHA-256 of the library at ``target``."""
    return target.with_name(target.name + ".sha256")


def _lock_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.lock")


def _compile(compiler: str, files: tuple[Path, ...], output: str) -> None:
    cmd = [compiler, *FLAGS, "-o", output, *(str(source.resolve()) for source in files), *LIBS]
    names = " and ".join(source.name for source in files)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CpuKernelUnavailable(f"compiling {names} with {compiler} failed: {e}") from None
    if done.returncode != 0:
        error = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise CpuKernelUnavailable(
            f"compiling {names} with {compiler} failed (exit {done.returncode}): " + " | ".join(error)
        )


def build(compiler: str, files: tuple[Path, ...], target: Path) -> None:
    """Compile ``files`` into ``target``, atomically, then record its checksum beside it (also atomically)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=disk_cache.scratch_prefix(), suffix=f"-{target.name}", dir=target.parent)
    except OSError as e:
        raise CpuKernelUnavailable(f"cannot write the kernel cache folder {target.parent}: {e}") from None
    os.close(fd)
    try:
        _compile(compiler, files, tmp)
        built = disk_cache.checksum(Path(tmp).read_bytes())
        os.replace(tmp, target)
        disk_cache.write_json_atomically(sidecar_path(target), built.to_json())
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class _Checked(NamedTuple):
    fd: int  # open on the library whose bytes were checked
    checksum: disk_cache.Checksum


def _open_checked(target: Path) -> _Checked | None:
    """The library at ``target`` opened for reading, when its bytes match its recorded checksum; else None."""
    try:
        record = json.loads(sidecar_path(target).read_text(encoding="utf-8"))
        expected = disk_cache.Checksum.from_json(record)
        fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        with open(fd, "rb", closefd=False) as f:
            if disk_cache.checksum(f.read()) == expected:
                return _Checked(fd, expected)
    except OSError:
        pass
    os.close(fd)
    return None


# Descriptors of the loaded libraries, open for the life of the process: each library was loaded through
# /proc/self/fd/<n>, and the dynamic loader would answer a later load of that name with the library it holds.
_LOADED_FDS: list[int] = []


def _dlopen(checked: _Checked, target: Path) -> ctypes.CDLL:
    """Load the checked library through its open descriptor, so the loader maps the very bytes that were checked
    even if another process renames a new library into place meanwhile (by name where /proc is not mounted)."""
    fd_path = f"/proc/self/fd/{checked.fd}"
    try:
        library = ctypes.CDLL(fd_path if os.path.exists(fd_path) else str(target))
    except OSError:
        os.close(checked.fd)
        raise
    _LOADED_FDS.append(checked.fd)
    return library


def _build_checked(compiler: str, target: Path, refused: disk_cache.Checksum | None) -> _Checked:
    """Holding the library's lock: the checked library, built first unless another process built it while this
    one waited (a library with the ``refused`` checksum does not count)."""
    try:
        lock = disk_cache.acquire(_lock_path(target))
    except OSError as e:
        raise CpuKernelUnavailable(f"cannot write the kernel cache folder {target.parent}: {e}") from None
    try:
        checked = _open_checked(target)
        if checked is not None and checked.checksum != refused:
            return checked
        if checked is not None:
            os.close(checked.fd)
        disk_cache.remove_stale_scratch(target.parent)
        build(compiler, sources(), target)
        checked = _open_checked(target)
        if checked is None:
            raise CpuKernelUnavailable(f"the library built at {target} does not match its recorded checksum")
        return checked
    finally:
        disk_cache.release(lock)


def _load(compiler: str) -> ctypes.CDLL:
    target = library_path(compiler)
    cached = _open_checked(target)
    refused = None
    if cached is not None:
        try:
            return _dlopen(cached, target)
        except OSError:  # checked bytes the loader refuses (another toolchain's runtime, say): rebuilt once
            refused = cached.checksum
    built = _build_checked(compiler, target, refused)
    try:
        return _dlopen(built, target)
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
