"""Incremental detokenization with stop strings: text released only once it is final (SERVE-4, SERVE-5).

Invariants: ``text`` is the decoded text of the first ``num_decoded`` tokens
and ends on a whole character: a token that leaves a multi-byte character
incomplete (the decoded tail is U+FFFD) is held until a later token completes
it, or until ``finish``. The released text (``take``) is always a prefix of
``finish()``'s result: it stops short of the first stop string and of any tail
that is a proper prefix of a stop string, since that tail may still become one.
Each stop string has a matcher (Knuth-Morris-Pratt) whose state is the longest
tail of ``text`` that begins it, so every character is read once per stop
string: a request costs O(text x stop strings + their total length), however
long they are (SERVE-16). While a character is incomplete the whole characters
before it are searched too (from a copy of the states), so the token that
completes a stop string ends it even when it also begins the next character.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"
MAX_CHAR_TOKENS = 4  # UTF-8 takes at most 4 bytes, so at most 4 byte-level tokens, per character


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class _StopMatcher:
    """One stop string's automaton; a state is how many of its first characters the text read so far ends with."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        # fallback[k]: the longest proper prefix of stop[:k + 1] that is also its suffix (the prefix function)
        self.fallback = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fallback[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fallback[i] = k

    def read(self, state: int, text: str, start: int) -> tuple[int, int | None]:
        """The state after ``text[start:]``, and where the first stop string completed in it begins (None: none;
        the state is then not advanced past it)."""
        stop, fallback = self.stop, self.fallback
        for i in range(start, len(text)):
            char = text[i]
            while state and stop[state] != char:
                state = fallback[state - 1]
            if stop[state] == char:
                state += 1
                if state == len(stop):
                    return state, i + 1 - len(stop)
        return state, None


class IncrementalDetokenizer:
    """The text of a growing list of completion tokens, and where the first stop string begins in it."""

    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._matchers = [_StopMatcher(s) for s in stop]
        self._states = [0] * len(self._matchers)  # each matcher's state after ``text``
        self._ids: list[int] = []
        self._context = 0  # decoding starts here: the previous read point, so a merge across tokens is seen
        self.num_decoded = 0  # tokens whose characters are all in ``text``
        self.text = ""
        self.stop_at: int | None = None  # index in ``text`` where the first stop string begins
        self._released = 0

    @property
    def num_tokens(self) -> int:
        return len(self._ids)

    @property
    def stopped(self) -> bool:
        return self.stop_at is not None

    def add(self, ids: Iterable[int]) -> bool:
        """Append tokens; True once a stop string is complete (it then ignores further tokens' text)."""
        self._ids.extend(ids)
        # The longest run of new tokens that ends on a whole character; a character spans at most
        # MAX_CHAR_TOKENS tokens, so fewer ends are tried.
        for end in range(len(self._ids), max(self.num_decoded, len(self._ids) - MAX_CHAR_TOKENS), -1):
            if self.stop_at is not None:
                break
            fresh = self._fresh_text(end)
            if fresh is not None:
                self._append(fresh, end)
                break
        if self.stop_at is None and self._matchers and self.num_decoded < len(self._ids):
            self._search_incomplete()
        return self.stop_at is not None

    def _search_incomplete(self) -> None:
        """A stop string may end in the whole characters before an incomplete one (a token that completes it
        can also begin the next character): search the held tail's text without its trailing U+FFFD too."""
        before = self._tokenizer.decode(self._ids[self._context : self.num_decoded])
        after = self._tokenizer.decode(self._ids[self._context :]).rstrip(REPLACEMENT)
        if len(after) <= len(before) or not after.startswith(before):
            return
        whole = self.text + after[len(before) :]
        hits = [at for m, state in zip(self._matchers, self._states, strict=True)
                if (at := m.read(state, whole, len(self.text))[1]) is not None]
        if hits:  # the request ends here: the text is final up to the stop string, which is all finish() keeps
            self.text, self.stop_at = whole, min(hits)

    def _fresh_text(self, end: int) -> str | None:
        """The text tokens up to ``end`` add, or None while it ends in an incomplete character."""
        before = self._tokenizer.decode(self._ids[self._context : self.num_decoded])
        after = self._tokenizer.decode(self._ids[self._context : end])
        if after.endswith(REPLACEMENT) or not after.startswith(before):
            return None
        return after[len(before) :]

    def _append(self, fresh: str, end: int) -> None:
        searched = len(self.text)
        self.text += fresh
        self._context, self.num_decoded = self.num_decoded, end
        self._search(searched)

    def _search(self, searched: int) -> None:
        """Read ``text[searched:]`` into every matcher; record the earliest stop string completed in it (the text
        before held none)."""
        hits = []
        for index, matcher in enumerate(self._matchers):
            self._states[index], at = matcher.read(self._states[index], self.text, searched)
            if at is not None:
                hits.append(at)
        if hits:
            self.stop_at = min(hits)

    def _final_length(self) -> int:
        """How much of ``text`` can never change: all before a stop string, or before the longest tail that begins
        one (it may still become one)."""
        if self.stop_at is not None:
            return self.stop_at
        return len(self.text) - max(self._states, default=0)

    def take(self) -> str:
        """The text final since the last ``take`` (may be empty)."""
        end = self._final_length()
        out = self.text[self._released : end]
        self._released = max(self._released, end)
        return out

    def finish(self) -> str:
        """All text once no token will come: the held tail decoded as it is, cut at the first stop string."""
        if self.stop_at is None and self.num_decoded < len(self._ids):
            whole = self._tokenizer.decode(self._ids)
            self._append(whole[len(self.text) :] if whole.startswith(self.text) else "", len(self._ids))
        return self.text if self.stop_at is None else self.text[: self.stop_at]

    def take_final(self) -> str:
        """``finish``, less what ``take`` released already."""
        text = self.finish()
        out = text[self._released :]
        self._released = len(text)
        return out
