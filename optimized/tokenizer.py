"""Text <-> token ids for a checkpoint folder, or a clear refusal when it has no tokenizer.

A folder with ``tokenizer.json`` is read with the ``tokenizers`` library (its
own post-processor decides BOS and friends); a folder with only
``tokenizer_config.json`` and slow-tokenizer files goes through transformers'
``AutoTokenizer``. A folder with neither still serves token-id prompts: only a
text prompt raises, naming the folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class _Fast:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.tok = HFTokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))


class _Auto:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir))

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


def load_tokenizer(model_dir: Path) -> Tokenizer:
    if (model_dir / "tokenizer.json").is_file():
        return _Fast(model_dir / "tokenizer.json")
    if (model_dir / "tokenizer_config.json").is_file():
        return _Auto(model_dir)
    return NoTokenizer(model_dir)
