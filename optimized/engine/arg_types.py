"""Argparse types for the ``nanoverify`` commands and ``EngineArgs``' flags: every value is refused at parse time
unless it is in range.

Each function here is an argparse ``type=``: it returns the parsed value or raises
``argparse.ArgumentTypeError`` with a one-line message ("must be an integer in
[1, 1048576], got -3"), which the parser prints as ``nanoverify <command>:
argument --flag: <message>`` and exit status 2 (spec/cli.md, CLI-2). No type here
imports torch, so a bad argument is refused before any heavy work.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from pathlib import Path

# The largest count any flag accepts (requests, lengths, blocks, batch sizes): a typo
# of a few extra digits is refused instead of allocated.
MAX_COUNT = 1 << 20
MAX_THREADS = 1024


def _shown(text: str) -> str:
    """``text`` quoted for a one-line message, cut short when long."""
    return repr(text if len(text) <= 40 else text[:40] + "...")


def bounded_int(least: int, most: int = MAX_COUNT) -> Callable[[str], int]:
    """A type accepting the integers in [least, most]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not least <= value <= most:
            raise argparse.ArgumentTypeError(f"must be an integer in [{least}, {most}], got {_shown(text)}")
        return value

    parse.__name__ = "integer"
    return parse


def any_int(text: str) -> int:
    """Any integer (seeds: every integer is a valid seed)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {_shown(text)}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {_shown(text)}") from None


def positive_seconds(text: str) -> float:
    """A finite number > 0."""
    value = _float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {_shown(text)}")
    return value


def minutes(text: str) -> float:
    """A number >= 0, or inf (run until interrupted); never nan."""
    value = _float(text)
    if not value >= 0:  # false for nan too
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (or inf), got {_shown(text)}")
    return value


def checkpoint_folder(text: str) -> str:
    """An existing folder (the model loader names what is wrong inside it); never '', which Path reads as the
    current folder."""
    if text == "":
        raise argparse.ArgumentTypeError("must be a checkpoint folder, got '' (an empty path)")
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"must be a checkpoint folder, got {_shown(text)} "
                                         f"({'not a folder' if Path(text).exists() else 'no such folder'})")
    return text


def file_path(text: str) -> str:
    """A file to write: never '' (Path's current folder) nor an existing folder; what the filesystem allows is
    checked when the file is opened."""
    if text == "":
        raise argparse.ArgumentTypeError("must be a file path, got '' (an empty path)")
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"must be a file path, got {_shown(text)} (a folder)")
    return text


DEVICE_RULE = "'cpu', 'cuda' or 'cuda:N' (N a GPU's index; 'cpu:0' is 'cpu', another CPU index is refused)"


def is_device_name(value: object) -> bool:
    """A device the engine runs on: 'cpu', 'cuda' or 'cuda:N'; 'cpu:0' too, which torch reads as 'cpu' (it
    ignores a CPU index, so another one would be silently ignored)."""
    return isinstance(value, str) and re.fullmatch(r"cpu(:0)?|cuda(:[0-9]+)?", value) is not None


def device_name(text: str) -> str:
    """A device name by ``is_device_name``."""
    if not is_device_name(text):
        raise argparse.ArgumentTypeError(f"must be {DEVICE_RULE}, got {_shown(text)}")
    return text


def work_folder(text: str) -> Path:
    """A folder to write in: existing, or not yet made; never an existing file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"must be a folder, got {_shown(text)} (a file)")
    return path


def utf8_text(text: str) -> str:
    """Text that encodes as UTF-8: an argv byte that is not UTF-8 arrives as a lone surrogate and is refused."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"U+{ord(bad):04X}"
        raise argparse.ArgumentTypeError(
            f"must be UTF-8 text, got {_shown(text)} ({byte} at position {e.start})") from None
    return text


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = positive_seconds(text)  # a finite number > 0, or its one-line refusal
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {_shown(text)}")
    return value
