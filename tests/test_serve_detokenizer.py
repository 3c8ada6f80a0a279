"""The server's text pieces: incremental detokenization, stop strings (also in ``LLM.generate``), chat templates."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from optimized import SamplingParams
from optimized.engine.detokenizer import IncrementalDetokenizer
from optimized.serve.chat import DEFAULT_TEMPLATE, load_chat_template


class Bytes:
    """A byte-level tokenizer, as the default model's: token b is byte b, decoded with replacement."""

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def feed(text: str, stop: tuple[str, ...] = (), per: int = 1) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ``text``'s bytes ``per`` at a time; the pieces ``take`` released after each, then ``take_final``'s."""
    data = list(text.encode())
    d = IncrementalDetokenizer(Bytes(), stop)
    pieces = []
    for i in range(0, len(data), per):
        if d.add(data[i : i + per]):
            break
        pieces.append(d.take())
    pieces.append(d.take_final())
    return pieces, d


@pytest.mark.clause("SERVE-4")
def test_a_multibyte_character_is_released_whole() -> None:
    """SERVE-4: a character split over tokens is held until its last byte arrives, never sent as U+FFFD."""
    text = "aé€😀b"
    pieces, _ = feed(text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "é" in pieces and "€" in pieces and "😀" in pieces  # each released in one piece, when complete
    # Bytes that never complete a character are released as U+FFFD once no token will come.
    d = IncrementalDetokenizer(Bytes())
    d.add([0x61, 0xE2, 0x82])
    assert d.take() == "a"
    assert d.take_final() == "\ufffd"


@pytest.mark.clause("SERVE-4", "SERVE-5")
def test_text_that_may_become_a_stop_string_is_held_back() -> None:
    """SERVE-5: a tail that is the start of a stop string waits; once it cannot become one, it is released."""
    d = IncrementalDetokenizer(Bytes(), ("STOP",))
    d.add(list(b"abST"))
    assert d.take() == "ab"  # "ST" may become "STOP"
    d.add(list(b"x"))
    assert d.take() == "STx"  # it did not
    assert not d.add(list(b"ySTO"))
    assert d.take() == "y"
    assert d.add(list(b"Pzz"))  # the token completing the stop string ends it
    assert d.take() == "" and d.take_final() == ""
    assert d.finish() == "abSTxy"


@pytest.mark.clause("SERVE-5")
@pytest.mark.parametrize("per", [1, 2, 5])
def test_stop_strings_across_token_boundaries(per: int) -> None:
    """SERVE-5: the earliest stop string wins wherever token boundaries fall; the text stops before it."""
    text = "one two three four"
    pieces, d = feed(text, ("four", "o t", "three"), per)
    assert d.stopped and d.finish() == "one tw"
    assert "".join(pieces) == "one tw"
    pieces, d = feed(text, ("zzz",), per)
    assert not d.stopped and "".join(pieces) == text


@pytest.mark.clause("SERVE-5")
def test_sampling_params_stop_is_validated() -> None:
    """SERVE-5: stop is a tuple of non-empty strings; one string means one stop string."""
    assert SamplingParams(stop="ab").stop == ("ab",)  # type: ignore[arg-type]
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")  # type: ignore[arg-type]
    for bad in ("", [""], [3], 5, ["\ud800"]):
        with pytest.raises(ValueError, match="stop"):
            SamplingParams(stop=bad)  # type: ignore[arg-type]


@pytest.mark.clause("SERVE-10")
def test_chat_templates(tmp_path: Path) -> None:
    """SERVE-10: a checkpoint's chat_template (a string, or the "default" of named ones) is used, with its special
    tokens; without one, nanoverify's documented template; a template that fails is a ValueError."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert load_chat_template(tmp_path).render(messages) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert load_chat_template(tmp_path).source == DEFAULT_TEMPLATE
    own = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ eos_token }}"
    config: dict[str, Any] = {"chat_template": own, "bos_token": "<s>", "eos_token": {"content": "</s>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(tmp_path).render(messages) == "<s>[system]Be brief.[user]Hi</s>"
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(tmp_path).render(messages) == "D"
    config["chat_template"] = "{{ raise_exception('no system messages') }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no system messages"):
        load_chat_template(tmp_path).render(messages)


class Vocabulary:
    """A tokenizer whose tokens are arbitrary byte strings (as a BPE vocabulary's are)."""

    def __init__(self, tokens: list[bytes]) -> None:
        self.tokens = tokens

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.tokens[i] for i in ids).decode("utf-8", errors="replace")


@pytest.mark.clause("SERVE-5")
def test_a_stop_string_ends_at_a_token_that_also_begins_a_character() -> None:
    """SERVE-5: the token that completes a stop string ends the request even when it also brings the first byte
    of a multi-byte character (its text then ends in an incomplete character): not one token later."""
    vocab = Vocabulary([b"a", b"x\xe2", b"\x82\xac", b"b"])  # "a", "x" + the first byte of "€", the rest of "€"
    d = IncrementalDetokenizer(vocab, ("x",))
    assert not d.add([0])
    assert d.add([1])  # "x" is complete: the stop string ends it here
    assert d.finish() == "a" and d.take_final() == "a"
    d = IncrementalDetokenizer(vocab, ("x\u20ac",))  # a stop string ending in that character waits for it
    assert not d.add([0, 1])
    assert d.take() == "a"
    assert d.add([2])
    assert d.finish() == "a"
    d = IncrementalDetokenizer(vocab, ("q",))  # no stop string: the character is released whole, as before
    d.add([0, 1])
    assert d.take() == "a"
    d.add([2, 3])
    assert d.take() == "x\u20acb"


def released_by_brute_force(text: str, stop: tuple[str, ...]) -> str:
    """SERVE-5's rule read literally: all before the earliest stop string, else all but the longest tail that
    begins one."""
    hits = [at for s in stop if (at := text.find(s)) >= 0]
    if hits:
        return text[: min(hits)]
    held = max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - held]


@pytest.mark.clause("SERVE-5", "SERVE-16")
@settings(max_examples=150, deadline=None)
@given(st.text(alphabet="aab\u20ac", max_size=24),
       st.lists(st.text(alphabet="ab\u20ac", min_size=1, max_size=5), min_size=1, max_size=4))
@example("aaab", ["aab"])  # a mismatch falls back to "a", not to nothing: the stop string is found
@example("aaa", ["aab"])  # likewise the held tail is "aa", not "a"
@example("aabaaab", ["aabaaaa"])  # a fallback table built by the same rule: "aabaaa" falls back to "aa"
def test_the_stop_search_releases_what_the_rule_says(text: str, stops: list[str]) -> None:
    """SERVE-5, SERVE-16: fed one character at a time, the released text is after every token what the rule
    read literally gives (self-overlapping stop strings such as "aab" in "aaab" included), and all of it up to the
    first stop string at the end."""
    d = IncrementalDetokenizer(Bytes(), tuple(stops))
    released = seen = ""
    for char in text:
        seen += char
        if d.add(list(char.encode())):
            assert any(s in seen for s in stops) and not any(s in seen[:-1] for s in stops)
            break
        released += d.take()
        assert released == released_by_brute_force(seen, tuple(stops))
    hits = [at for s in stops if (at := seen.find(s)) >= 0]
    assert released + d.take_final() == seen[: min(hits, default=len(seen))]  # at the end a held tail is final


def stop_search_seconds(stop: tuple[str, ...], chars: int = 1500) -> float:
    """The CPU time of a ``chars``-token request with ``stop``, one character per token, released every step (the
    least of three runs)."""
    best = math.inf
    for _ in range(3):
        start = time.process_time()
        d = IncrementalDetokenizer(Bytes(), stop)
        for _ in range(chars):
            d.add([ord("x")])
            d.take()
        best = min(best, time.process_time() - start)
    return best


@pytest.mark.clause("SERVE-16")
def test_the_stop_search_costs_the_same_for_long_stop_strings() -> None:
    """SERVE-16: every character is read once per stop string, so four stop strings of 1024 characters cost about
    what four of 8 cost (a search that tried every tail that may begin one cost about 100 times as much)."""
    short = stop_search_seconds(tuple(c * 8 for c in "yzwv"))
    long = stop_search_seconds(tuple(c * 1024 for c in "yzwv"))
    assert long < 10 * short + 0.01, (long, short)


@pytest.mark.clause("SERVE-16")
def test_sampling_params_bound_the_stop_strings_length() -> None:
    """SERVE-16: the stop strings total at most 4096 characters; past it a ValueError names stop."""
    assert SamplingParams(stop=("a" * 4000, "b" * 96)).stop[1] == "b" * 96
    with pytest.raises(ValueError, match=r"^stop strings must total at most 4096 characters, got 4097$"):
        SamplingParams(stop=("a" * 4000, "b" * 97))
