"""Text <-> token ids for a checkpoint folder, or a clear refusal when it has no tokenizer.

A folder with ``tokenizer.json`` is read with the ``tokenizers`` library (its
own post-processor decides BOS and friends); a folder with only
``tokenizer_config.json`` and slow-tokenizer files goes through transformers'
``AutoTokenizer``. A folder with neither still serves token-id prompts: only a
text prompt raises, naming the folder.

A tokenizer file that is present but damaged (not a regular file, too large, not a JSON object, or refused by
the library that reads it) is a ValueError naming it, raised when the folder is loaded (CKPT-1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from optimized.models.checkpoint_files import (
    TOKENIZER_JSON_LIMIT,
    parse_json_object,
    read_bytes,
    read_json_object,
    regular_file,
)


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class _Fast:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        data = read_bytes(path, TOKENIZER_JSON_LIMIT)
        parse_json_object(data, path)  # the library's own message for bad JSON names no file
        try:
            self.tok = HFTokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # the library raises bare Exception for every refusal
            raise ValueError(f"{path}: not a tokenizer the tokenizers library can read ({_first_line(e)})") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))


class _Auto:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        path = model_dir / "tokenizer_config.json"
        read_json_object(path)
        try:
            self.tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except Exception as e:  # transformers raises many kinds (OSError, KeyError, TypeError...) for bad files
            raise ValueError(f"{path}: transformers cannot build a tokenizer from it ({_first_line(e)})") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))


class NoTokenizer:
    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir

    def encode(self, text: str) -> list[int]:
        raise ValueError(f"prompts: {self.model_dir} has no tokenizer files; pass token-id prompts (list[int])")

    def decode(self, ids: list[int]) -> str:
        return ""


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else type(e).__name__
    return line if len(line) <= 200 else line[:197] + "..."


def load_tokenizer(model_dir: Path) -> Tokenizer:
    if regular_file(model_dir / "tokenizer.json"):
        return _Fast(model_dir / "tokenizer.json")
    if regular_file(model_dir / "tokenizer_config.json"):
        return _Auto(model_dir)
    return NoTokenizer(model_dir)
