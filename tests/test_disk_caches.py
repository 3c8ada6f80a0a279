"""The on-disk caches (spec/caches.md): a damaged compiled kernel or default model is found and replaced whole,
scratch left by a killed maker is cleaned up, and a cache that cannot be written says so in one clear error.

The C library is compiled once for the module; most rebuilds below run the build path with a stand-in compiler
that writes those bytes (the build's temp file, rename, checksum and load are the real ones), and one runs the real
compiler in two processes at once. Loads of a truncated library run in a subprocess: mapping one kills the process
with SIGBUS. Every test points NANOVERIFY_CACHE (or HOME) at a temporary folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from kernels import cpu_build
from optimized.models import default_model

ROOT = Path(__file__).resolve().parent.parent
SIGBUS_EXIT = -7
MANIFEST = "nanoverify-manifest.json"

# Loads the kernel library from $NANOVERIFY_CACHE and checks a decode against torch; argv: a log file that gets a
# line per compiler run, and the bytes a stand-in compiler writes ("" for the real compiler).
LOAD_AND_DECODE = r"""
import subprocess, sys
import torch
from kernels import cpu_attention, cpu_build, paged_attention

log, stand_in = sys.argv[1], sys.argv[2]
real_run = subprocess.run

def compile_logged(cmd, *args, **kwargs):
    with open(log, "a") as f:
        f.write("compile\n")
    if not stand_in:
        return real_run(cmd, *args, **kwargs)
    with open(stand_in, "rb") as src, open(cmd[cmd.index("-o") + 1], "wb") as dst:
        dst.write(src.read())
    return subprocess.CompletedProcess(cmd, 0, "", "")

subprocess.run = compile_logged
reason = cpu_build.unavailable_reason()
assert reason is None, reason
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(*shape, generator=g) for shape in ((2, 4, 16), (3, 4, 2, 16), (3, 4, 2, 16)))
lens = torch.tensor([5, 9], dtype=torch.int32)
tables = torch.tensor([[0, 1, -1], [2, 0, 1]], dtype=torch.int32)
got = cpu_attention.paged_decode(q, k, v, lens, tables, 0.25)
torch.testing.assert_close(got, paged_attention.paged_decode(q, k, v, lens, tables, 0.25), rtol=1e-5, atol=1e-5)
print("decode ok")
"""


class Library(NamedTuple):
    name: str  # the library's file name in <cache>/kernels
    data: bytes  # a good build of it
    stand_in: Path  # a copy of those bytes outside every cache


def sidecar(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def record_of(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def replace_file(library: Path, data: bytes) -> None:
    """Put ``data`` at ``library``'s path as a new file: this process may have the old one mapped, and changing a
    mapped library in place would crash it (SIGBUS) the next time its pages are read, at exit at the latest."""
    scratch = library.with_name(library.name + ".test-scratch")
    scratch.write_bytes(data)
    os.replace(scratch, library)


def write_record(library: Path, data: bytes) -> None:
    """A checksum beside ``library`` that records ``data``."""
    sidecar(library).write_text(json.dumps(record_of(data)), encoding="utf-8")


def recorded(library: Path) -> dict[str, Any]:
    checksum: dict[str, Any] = json.loads(sidecar(library).read_text(encoding="utf-8"))
    return checksum


@pytest.fixture(scope="module")
def good_library(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Library]:
    compiler = cpu_build.find_compiler()
    if compiler is None:
        pytest.skip("no C compiler on the PATH")
    root = tmp_path_factory.mktemp("built")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOVERIFY_CACHE", str(root))
        cpu_build.forget()
        assert cpu_build.unavailable_reason() is None
        target = cpu_build.library_path(compiler)
    cpu_build.forget()
    stand_in = root / "stand-in.so"
    shutil.copyfile(target, stand_in)
    yield Library(target.name, target.read_bytes(), stand_in)
    cpu_build.forget()


@pytest.fixture
def kernel_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty cache root for this process (NANOVERIFY_CACHE), not yet loaded from."""
    monkeypatch.setenv("NANOVERIFY_CACHE", str(tmp_path))
    cpu_build.forget()
    yield tmp_path
    cpu_build.forget()


def cached_library(root: Path, library: Library, with_sidecar: bool = True) -> Path:
    """A copy of the good library (and its checksum) in the cache under ``root``: new files, never the mapped ones."""
    target = root / "kernels" / library.name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(library.data)
    if with_sidecar:
        write_record(target, library.data)
    return target


def load_in_subprocess(root: Path, log: Path, stand_in: Path | None) -> subprocess.Popen[str]:
    env = {**os.environ, "NANOVERIFY_CACHE": str(root), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-c", LOAD_AND_DECODE, str(log), str(stand_in or "")]
    return subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def outcome(process: subprocess.Popen[str]) -> tuple[int, str]:
    out, _ = process.communicate(timeout=180)
    return process.returncode, out


def assert_whole(target: Path, data: bytes | None = None) -> None:
    """The cached library matches its checksum (and, when given, these bytes); no scratch is left beside it."""
    got = target.read_bytes()
    assert recorded(target) == record_of(got)
    if data is not None:
        assert got == data
    assert not [p.name for p in target.parent.iterdir() if p.name.startswith((".making-", ".damaged-"))]


def compile_counter(monkeypatch: pytest.MonkeyPatch, output: bytes) -> list[list[str]]:
    """Replace the compiler by a stand-in writing ``output``; returns the list of its command lines."""
    calls: list[list[str]] = []

    def stand_in(cmd: list[str], *args: Any, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        Path(cmd[cmd.index("-o") + 1]).write_bytes(output)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", stand_in)  # the build calls subprocess.run
    return calls


@pytest.mark.clause("DISK-1", "DISK-2")
@pytest.mark.parametrize("size", [1000, 4096, "half"])
def test_a_truncated_library_is_rebuilt_never_mapped(good_library: Library, tmp_path: Path, size: int | str) -> None:
    """DISK-1, DISK-2: a library truncated at rest (to 1,000 or 4,096 bytes, or half its size) is never handed to
    the dynamic loader (that dies of SIGBUS): the next process rebuilds it, loads the rebuilt bytes and decodes
    right, and the cache holds a whole library and its checksum again."""
    target = cached_library(tmp_path, good_library)
    with open(target, "r+b") as f:
        f.truncate(len(good_library.data) // 2 if size == "half" else int(size))
    log = tmp_path / "compiles.log"
    rc, out = outcome(load_in_subprocess(tmp_path, log, good_library.stand_in))
    assert rc != SIGBUS_EXIT, "the truncated library was mapped (SIGBUS)"
    assert rc == 0 and "decode ok" in out, out
    assert log.read_text().count("compile") == 1
    assert_whole(target, good_library.data)


@pytest.mark.clause("DISK-2", "DISK-3")
def test_two_processes_finding_a_damaged_library_compile_it_once(good_library: Library, tmp_path: Path) -> None:
    """DISK-2, DISK-3: two processes started together on a truncated library both load a good one and decode
    right; the real compiler runs once, since the second waits on the entry's lock and then finds it whole."""
    target = cached_library(tmp_path, good_library)
    with open(target, "r+b") as f:
        f.truncate(len(good_library.data) // 2)
    log = tmp_path / "compiles.log"
    processes = [load_in_subprocess(tmp_path, log, None) for _ in range(2)]
    for rc, out in [outcome(p) for p in processes]:
        assert rc == 0 and "decode ok" in out, out
    assert log.read_text().count("compile") == 1
    assert_whole(target)


@pytest.mark.clause("DISK-1", "DISK-2")
def test_a_library_without_a_matching_checksum_is_rebuilt_before_loading(
    good_library: Library, kernel_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DISK-1, DISK-2: a library with no checksum beside it (as older versions left it), or whose bytes differ
    from it (one byte changed, size the same), or whose checksum record is garbage, is rebuilt before anything is
    loaded; a whole one with its checksum is loaded as it is, taking no lock (as in a read-only cache)."""
    calls = compile_counter(monkeypatch, good_library.data)
    target = cached_library(kernel_cache, good_library, with_sidecar=False)
    assert cpu_build.unavailable_reason() is None
    assert len(calls) == 1
    assert_whole(target, good_library.data)
    damaged = bytearray(good_library.data)
    damaged[-20] ^= 0xFF  # in the section headers, which the loader does not read: it would load
    for damage in ("byte", "record"):
        cpu_build.forget()
        if damage == "byte":
            replace_file(target, bytes(damaged))
        else:
            sidecar(target).write_text("{not json", encoding="utf-8")
        assert cpu_build.unavailable_reason() is None
        assert_whole(target, good_library.data)
    assert len(calls) == 3
    cpu_build.forget()  # whole: loaded without the compiler and without the lock (a folder cannot be locked)
    lock = target.with_name(f".{target.name}.lock")
    lock.unlink()
    lock.mkdir()
    assert cpu_build.unavailable_reason() is None
    assert len(calls) == 3


@pytest.mark.clause("DISK-2", "KERN-24")
def test_a_checked_library_the_loader_refuses_is_rebuilt_once(
    good_library: Library, kernel_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DISK-2: a cached library whose checksum matches but which the dynamic loader refuses is rebuilt once; when
    the rebuilt one is refused too, the kernel is unavailable with the loader's reason (KERN-24 falls back)."""
    target = cached_library(kernel_cache, good_library)
    garbage = b"not an ELF file " * 64
    replace_file(target, garbage)
    write_record(target, garbage)
    calls = compile_counter(monkeypatch, good_library.data)
    assert cpu_build.unavailable_reason() is None
    assert len(calls) == 1
    assert_whole(target, good_library.data)
    cpu_build.forget()
    replace_file(target, garbage)
    write_record(target, garbage)
    calls = compile_counter(monkeypatch, garbage + b"!")
    reason = cpu_build.unavailable_reason()
    assert reason is not None and reason.startswith(f"loading {target} failed") and len(calls) == 1


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


@pytest.mark.clause("DISK-6")
def test_a_killed_builds_temp_file_is_removed_at_the_next_build(
    good_library: Library, kernel_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DISK-6: temp files of a build whose process is gone are removed when the library is next rebuilt; one of a
    live process is kept."""
    folder = kernel_cache / "kernels"
    folder.mkdir()
    with subprocess.Popen(["sleep", "60"]) as live:
        try:
            stale = folder / f".making-{dead_pid()}-x1y2z3{good_library.name}"
            kept = folder / f".making-{live.pid}-x1y2z3{good_library.name}"
            for scratch in (stale, kept):
                scratch.write_bytes(good_library.data[:1000])
            compile_counter(monkeypatch, good_library.data)
            assert cpu_build.unavailable_reason() is None
            assert not stale.exists() and kept.exists()
        finally:
            live.kill()


@pytest.mark.clause("DISK-7", "KERN-24")
@pytest.mark.parametrize("home", ["/proc", "a-file"])
def test_an_unwritable_kernel_cache_falls_back_to_torch(
    home: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DISK-7, KERN-24: with no NANOVERIFY_CACHE and HOME=/proc or HOME a regular file, the kernel cache cannot be
    written: get_backend(None, cpu) warns with the folder and falls back to torch, nothing raised."""
    import torch

    from kernels.backend import get_backend

    if home == "a-file":
        home = str(tmp_path / "a-file")
        Path(home).write_text("", encoding="utf-8")
    monkeypatch.delenv("NANOVERIFY_CACHE", raising=False)
    monkeypatch.setenv("HOME", home)
    cpu_build.forget()
    try:
        with pytest.warns(RuntimeWarning, match=f"cannot write the kernel cache folder {home}/.cache/nanoverify"):
            assert get_backend(None, torch.device("cpu")).name == "torch"
    finally:
        cpu_build.forget()


# -- the default model --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The default model's files, as made once into a cache of their own."""
    root = tmp_path_factory.mktemp("model")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOVERIFY_CACHE", str(root))
        folder = default_model.default_model_dir()
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.fixture
def model_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("NANOVERIFY_CACHE", str(tmp_path))
    return tmp_path


def cached_model(root: Path, files: dict[str, bytes]) -> Path:
    folder = root / f"default-qwen3-{default_model.VERSION}"
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def scratch(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith((".making-", ".damaged-")))


def make_counter(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    calls: list[Path] = []
    write = default_model.write_checkpoint

    def counted(folder: Path) -> None:
        calls.append(folder)
        write(folder)

    monkeypatch.setattr(default_model, "write_checkpoint", counted)
    return calls


DAMAGES: dict[str, tuple[str, Callable[[bytes], bytes] | None]] = {
    "weights truncated to 1000 bytes": ("model.safetensors", lambda data: data[:1000]),
    "weights truncated to half": ("model.safetensors", lambda data: data[: len(data) // 2]),
    "config.json not JSON": ("config.json", lambda data: b"[" + data[1:]),
    "tokenizer.json, one byte changed": ("tokenizer.json", lambda data: data[:99] + bytes([data[99] ^ 1]) + data[100:]),
    "tokenizer_config.json removed": ("tokenizer_config.json", None),
    "the manifest removed": (MANIFEST, None),
    "the manifest not listing the weights": (
        MANIFEST,
        lambda data: json.dumps(
            {name: record for name, record in json.loads(data).items() if name != "model.safetensors"}
        ).encode(),
    ),
}


@pytest.mark.clause("DISK-4", "DISK-5")
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_default_model_is_made_again_whole(
    damage: str, good_model: dict[str, bytes], model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DISK-4, DISK-5: a cached default model with a file truncated, changed, or missing (its manifest included) is
    found damaged when next used and made again whole: every file equals a fresh make's, and nothing is left
    beside it."""
    folder = cached_model(model_cache, good_model)
    name, change = DAMAGES[damage]
    if change is None:
        (folder / name).unlink()
    else:
        (folder / name).write_bytes(change(good_model[name]))
    calls = make_counter(monkeypatch)
    assert default_model.default_model_dir() == folder
    assert len(calls) == 1
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == good_model
    assert scratch(model_cache) == []


@pytest.mark.clause("DISK-4")
def test_a_whole_default_model_is_used_as_it_is(
    good_model: dict[str, bytes], model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DISK-4: a whole default model is checked and used in place: not made again, not moved, and without its lock
    (here a folder, which cannot be locked), as in a read-only cache."""
    folder = cached_model(model_cache, good_model)
    (model_cache / f".{folder.name}.lock").mkdir()
    inode = (folder / "model.safetensors").stat().st_ino
    calls = make_counter(monkeypatch)
    assert default_model.default_model_dir() == folder and calls == []
    assert (folder / "model.safetensors").stat().st_ino == inode


MAKE_THEN_WAIT = r"""
import sys, time
from optimized.models import default_model

write = default_model.write_checkpoint

def slow(folder):
    (folder / "config.json").write_text("{}")
    print("making", flush=True)
    time.sleep(float(sys.argv[1]))
    write(folder)

default_model.write_checkpoint = slow
default_model.default_model_dir()
print("made", flush=True)
"""


def start_making(root: Path, wait_s: float) -> subprocess.Popen[str]:
    """A process making the default model under ``root`` that waits ``wait_s`` seconds in the middle."""
    env = {**os.environ, "NANOVERIFY_CACHE": str(root), "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-c", MAKE_THEN_WAIT, str(wait_s)], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline() == "making\n"
    return process


@pytest.mark.clause("DISK-5", "DISK-6")
def test_a_make_killed_midway_leaves_nothing_behind(
    good_model: dict[str, bytes], model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DISK-5, DISK-6: a first-use make killed mid-way leaves its scratch folder; the next use (here LLM(None))
    removes it (its maker is gone), makes the model whole and loads it."""
    from optimized import LLM

    maker = start_making(model_cache, 60)
    maker.kill()
    maker.wait()
    assert len(scratch(model_cache)) == 1
    llm = LLM(None, num_kvcache_blocks=8, attention_backend="torch")
    assert {p.name: p.read_bytes() for p in llm.model_dir.iterdir()} == good_model
    assert scratch(model_cache) == []


@pytest.mark.clause("DISK-6")
def test_scratch_of_a_live_maker_is_never_removed(
    good_model: dict[str, bytes], model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DISK-6: when the model is made, scratch named with a gone process's pid, and nameless (older versions')
    scratch untouched for over an hour, are removed; scratch of a live pid, and recent nameless scratch, are
    kept."""
    now = time.time()
    with subprocess.Popen(["sleep", "60"]) as live:
        try:
            names = {
                f".making-{dead_pid()}-abc": False,
                f".damaged-{dead_pid()}-abc": False,
                ".making-old12345": False,
                f".making-{live.pid}-abc": True,
                f".damaged-{live.pid}-abc": True,
                ".making-new12345": True,
            }
            for name in names:
                (model_cache / name).mkdir()
                (model_cache / name / "config.json").write_text("{}", encoding="utf-8")
            os.utime(model_cache / ".making-old12345", (now - 7200, now - 7200))
            default_model.default_model_dir()
            assert scratch(model_cache) == sorted(name for name, kept in names.items() if kept)
        finally:
            live.kill()


@pytest.mark.clause("DISK-5")
def test_a_use_during_a_make_waits_for_it_and_makes_nothing(
    good_model: dict[str, bytes], model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DISK-5: a process that finds the model missing while another is making it waits for that make (the entry's
    lock) and uses its result: the model is made once, and the live maker's scratch is never touched."""
    maker = start_making(model_cache, 1.5)
    try:
        calls = make_counter(monkeypatch)
        folder = default_model.default_model_dir()
        assert calls == []
        assert maker.stdout is not None and maker.stdout.read() == "made\n"
    finally:
        maker.kill()
        maker.wait()
    assert maker.returncode == 0
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == good_model


@pytest.mark.clause("DISK-7")
@pytest.mark.parametrize("where", ["HOME=/proc", "HOME=a file", "NANOVERIFY_CACHE=a file"])
def test_an_unwritable_cache_is_one_clear_error(where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DISK-7: with HOME=/proc or HOME a regular file (and no NANOVERIFY_CACHE), or NANOVERIFY_CACHE a regular file,
    making the default model raises one DefaultModelUnavailable (an OSError, nothing chained) naming the folder it
    tried, the OS's reason, and NANOVERIFY_CACHE; LLM(None) raises the same before loading anything."""
    from optimized import LLM

    a_file = tmp_path / "a-file"
    a_file.write_text("", encoding="utf-8")
    variable, value = where.split("=")
    value = str(a_file) if value == "a file" else value
    monkeypatch.delenv("NANOVERIFY_CACHE", raising=False)
    monkeypatch.setenv(variable, value)
    root = f"{value}/.cache/nanoverify" if variable == "HOME" else value
    unavailable = default_model.DefaultModelUnavailable
    assert issubclass(unavailable, OSError)
    for make in (default_model.default_model_dir, lambda: LLM(None)):
        with pytest.raises(unavailable) as info:
            make()
        message = str(info.value)
        assert f"{root}/default-qwen3-{default_model.VERSION}" in message and "NANOVERIFY_CACHE" in message, message
        reasons = ("Not a directory", "No such file", "Permission denied", "not a folder")
        assert any(reason in message for reason in reasons), message
        assert info.value.__cause__ is None and info.value.__suppress_context__


FULL_DISK = r"""
import resource, signal, sys
from optimized.models import default_model

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
try:
    default_model.default_model_dir()
except default_model.DefaultModelUnavailable as e:
    print(type(e).__name__, e.__cause__ is None, e)
"""


@pytest.mark.clause("DISK-7")
def test_a_write_that_fails_while_making_the_model_is_one_clear_error(tmp_path: Path) -> None:
    """DISK-7: a disk that fills up while the weights are written (a file-size limit here) is the same one
    DefaultModelUnavailable naming the folder and the reason, not the tensor library's own error; nothing is left."""
    env = {**os.environ, "NANOVERIFY_CACHE": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", FULL_DISK], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("DefaultModelUnavailable True cannot make the default model in "), done.stdout
    assert "File too large" in done.stdout and "NANOVERIFY_CACHE" in done.stdout
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
