"""Reading a checkpoint folder's files as hostile bytes: every defect is one ValueError naming the file.

Invariant: nothing here follows a path that is not a regular file (a directory, a FIFO or a device is refused
before it is opened, so nothing hangs), reads more than a stated bound, or lets an OSError, a decoding error or
a RecursionError through. ``read_json_object`` serves config.json, generation_config.json and the tokenizer's
JSON files (CKPT-1); ``read_safetensors_header`` reads a safetensors file's header alone, every tensor's
name, dtype, shape and byte range, without touching the data, and checks it against the file's size (CKPT-2).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

JSON_LIMIT = 16 << 20  # config.json and friends are a few KB; 16 MiB leaves room for any real one
TOKENIZER_JSON_LIMIT = 512 << 20  # real tokenizer.json files reach ~35 MB
HEADER_LIMIT = 100_000_000  # the safetensors library's own bound on a header
FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
OTHER_DTYPES = {"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"}


def regular_file(path: Path) -> bool:
    """True when ``path`` is a regular file (links followed); False when absent. Anything else is refused."""
    try:
        if path.is_file():
            return True
        exists = path.exists() or path.is_symlink()
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None
    if exists:
        raise ValueError(f"{path}: is not a regular file")
    return False


def read_bytes(path: Path, limit: int) -> bytes:
    """The whole of the regular file ``path``, refused beyond ``limit`` bytes."""
    if not regular_file(path):
        raise ValueError(f"{path}: no such file")
    try:
        with path.open("rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None
    if len(data) > limit:
        raise ValueError(f"{path}: larger than {limit} bytes")
    return data


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def parse_json_object(data: bytes, path: Path) -> dict[str, Any]:
    """``data`` as one JSON object (UTF-8, no NaN/Infinity, bounded nesting), refusals naming ``path``."""
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(value).__name__}")
    return value


def read_json_object(path: Path, limit: int = JSON_LIMIT) -> dict[str, Any]:
    return parse_json_object(read_bytes(path, limit), path)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header describes it."""

    dtype: str
    shape: tuple[int, ...]


def _tensor_info(path: Path, name: str, entry: object, data_len: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: header entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or (dtype not in FLOAT_DTYPES and dtype not in OTHER_DTYPES):
        raise ValueError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise ValueError(f"{path}: tensor {name!r} has shape {shape!r}, not a list of sizes")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(n) is int for n in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_len
    ):
        raise ValueError(f"{path}: tensor {name!r} has data_offsets {offsets!r} outside the file's {data_len} bytes")
    size = FLOAT_DTYPES.get(dtype)
    if size is not None and offsets[1] - offsets[0] != math.prod(shape) * size:
        raise ValueError(f"{path}: tensor {name!r} of shape {shape} holds {offsets[1] - offsets[0]} bytes")
    return TensorInfo(dtype, tuple(shape))


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor name -> dtype and shape, from the header of the safetensors file ``path`` (data not read)."""
    if not regular_file(path):
        raise ValueError(f"{path}: no such file")
    try:
        with path.open("rb") as f:
            file_size = f.seek(0, 2)
            f.seek(0)
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ValueError(f"{path}: not a safetensors file ({file_size} bytes, shorter than its header)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(HEADER_LIMIT, file_size - 8):
                raise ValueError(f"{path}: header length {header_len} exceeds the file or {HEADER_LIMIT} bytes")
            header = f.read(header_len)
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None
    entries = parse_json_object(header, path)
    data_len = file_size - 8 - header_len
    return {
        name: _tensor_info(path, name, entry, data_len) for name, entry in entries.items() if name != "__metadata__"
    }
