"""What the on-disk caches (the compiled kernels, the default model) share: checksums, a lock, scratch names.

Invariants: a cached file counts as whole only when its size and SHA-256 equal a record written after it. Every
file or folder is first written under a scratch name ``.making-<pid>-<random>`` (a folder moved aside, under
``.damaged-<pid>-<random>``) in the folder of its final name, then renamed, so a name holds either nothing or a
whole thing. Whoever replaces a cache entry holds that entry's exclusive lock (``flock`` on a lock file beside it,
released by the kernel when its holder dies), so processes that find an entry damaged at once replace it once. Under
that lock, scratch whose maker is gone is removed: one whose pid is no live process, or, for a name with no pid (as
older versions wrote), one untouched for ``STALE_AFTER_S``. Scratch of a live process is never removed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

STALE_AFTER_S = 3600.0
_SCRATCH = re.compile(r"^\.(making|damaged)-(?:(\d+)-)?")
_CHUNK = 1 << 20


class Checksum(NamedTuple):
    size: int
    sha256: str

    def to_json(self) -> dict[str, int | str]:
        return {"size": self.size, "sha256": self.sha256}

    @staticmethod
    def from_json(value: object) -> Checksum:
        """The checksum a record holds; ValueError when it is not one."""
        if not isinstance(value, dict) or set(value) != {"size", "sha256"}:
            raise ValueError(f"not a checksum record: {value!r}")
        size, sha = value["size"], value["sha256"]
        if type(size) is not int or size < 0 or not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise ValueError(f"not a checksum record: {value!r}")
        return Checksum(size, sha)


def checksum(data: bytes) -> Checksum:
    return Checksum(len(data), hashlib.sha256(data).hexdigest())


def file_checksum(path: Path, expected_size: int | None = None) -> Checksum | None:
    """The checksum of the file at ``path``; None when it cannot be read, or when ``expected_size`` is given and
    the file's size differs (a truncated file is rejected without being read)."""
    try:
        with open(path, "rb") as f:
            if expected_size is not None and os.fstat(f.fileno()).st_size != expected_size:
                return None
            digest, size = hashlib.sha256(), 0
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
    except OSError:
        return None
    return Checksum(size, digest.hexdigest())


def write_json_atomically(path: Path, value: object) -> None:
    """Write ``value`` as JSON to ``path`` through a scratch file renamed into place."""
    scratch = path.with_name(scratch_prefix() + path.name)
    try:
        scratch.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(scratch, path)
    finally:
        scratch.unlink(missing_ok=True)


def scratch_prefix(kind: str = "making") -> str:
    """The start of a scratch name of this process: ``.making-<pid>-`` (or ``.damaged-<pid>-``)."""
    return f".{kind}-{os.getpid()}-"


def acquire(lock: Path) -> int:
    """Take the exclusive lock on the file ``lock`` (created, with its folder, if missing), waiting for it; the
    returned descriptor holds it until ``release``. OSError when the file cannot be created."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)  # flock needs no write access
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


def release(fd: int) -> None:
    os.close(fd)  # closing the descriptor releases its lock


@contextmanager
def exclusive(lock: Path) -> Iterator[None]:
    """Hold the exclusive lock on the file ``lock`` (see ``acquire``)."""
    fd = acquire(lock)
    try:
        yield
    finally:
        release(fd)


def _pid_is_live(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def maker_is_gone(path: Path, now: float) -> bool:
    """Whether ``path`` is scratch whose maker is gone (see the module docstring)."""
    match = _SCRATCH.match(path.name)
    if match is None:
        return False
    if match.group(2) is not None:
        pid = int(match.group(2))
        return pid > 0 and not _pid_is_live(pid)
    try:
        return now - path.lstat().st_mtime > STALE_AFTER_S
    except OSError:
        return False


def remove(path: Path) -> None:
    """Remove a file, link or folder tree at ``path``, if any."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale_scratch(folder: Path) -> None:
    """Remove the scratch in ``folder`` whose maker is gone; call it holding the folder's entry lock."""
    now = time.time()
    try:
        entries = list(folder.iterdir())
    except OSError:
        return
    for entry in entries:
        if maker_is_gone(entry, now):
            remove(entry)
