"""Logprobs on the wire, in OpenAI's two shapes (SERVE-6).

Invariant: every value is the engine's own ``Logprob.logprob`` (ENG-18) as a JSON number, except below
``FLOOR`` (``-inf`` has no JSON form), which is sent as ``FLOOR``, as vLLM does. A token's text is its id
decoded alone; its ``bytes`` (chat) are that text's UTF-8, so a token holding part of a character reads as
U+FFFD, as in vLLM. Where two of a position's alternatives decode to the same text, the legacy shape's
``top_logprobs`` object keeps the more likely one.
"""

from __future__ import annotations

from typing import Any

from optimized.engine.sampling_params import Logprob
from optimized.models.tokenizer import Tokenizer

FLOOR = -9999.0


def _value(lp: Logprob) -> float:
    return max(lp.logprob, FLOOR)


class LogprobsWire:
    """One request's logprobs as completions (``legacy``) or chat (``content``) send them; ``offset`` is the next
    token's text offset in the completion (legacy), kept across a stream's chunks."""

    def __init__(self, tokenizer: Tokenizer, top: int) -> None:
        self.tokenizer = tokenizer
        self.top = top
        self.offset = 0

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def legacy(self, tokens: list[int], entries: list[dict[int, Logprob]]) -> dict[str, Any]:
        """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``: each position's object holds its top
        alternatives and the drawn token (vLLM's), by rank."""
        texts = [self._text(t) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        tops = []
        for entry in entries:
            top: dict[str, float] = {}
            for t, lp in entry.items():
                top.setdefault(self._text(t), _value(lp))
            tops.append(top)
        return {"tokens": texts, "token_logprobs": [_value(e[t]) for t, e in zip(tokens, entries, strict=True)],
                "top_logprobs": tops, "text_offset": offsets}

    def content(self, tokens: list[int], entries: list[dict[int, Logprob]]) -> dict[str, Any]:
        """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``, ``top_logprobs`` the
        ``top`` most likely tokens by rank."""
        return {"content": [{**self._one(t, e[t]), "top_logprobs": [self._one(i, lp) for i, lp in e.items()
                                                                    if lp.rank <= self.top]}
                            for t, e in zip(tokens, entries, strict=True)], "refusal": None}

    def _one(self, token: int, lp: Logprob) -> dict[str, Any]:
        text = self._text(token)
        return {"token": text, "logprob": _value(lp), "bytes": list(text.encode("utf-8"))}
