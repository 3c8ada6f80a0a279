"""The OpenAI request bodies the server accepts, and its error shape (SERVE-9).

Invariant: this module checks the wire shape only, and a body either becomes a
typed request here or an ``ApiError`` whose message and ``param`` name the field
at fault. Models are strict (a string is never taken for a number, nor a number
for a bool), require what OpenAI requires and ignore unknown fields, as OpenAI
does; OpenAI fields that would change the answer and are not implemented
(``echo``, ``best_of``, ``n`` but 1...) are refused unless they hold the value
that changes nothing. Values (ranges, limits) are not checked here: the one
validator does that for HTTP and Python alike (``entry.requests.validated_request``,
ARCH-6), and app.py answers its ``RequestRefused``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from itertools import accumulate
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

M = TypeVar("M", bound="_Sampling")
MAX_BODY_DEPTH = 32  # SERVE-15: arrays and objects in a body; OpenAI's deepest field here nests 5 levels
_FINITE = Field(default=None, allow_inf_nan=False)  # SERVE-15: JSON's NaN and Infinity are no temperature


class ApiError(Exception):
    """An error answered as OpenAI's ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields common to both endpoints (OpenAI's, then vLLM's extras); None: ``SamplingParams``' default."""

    model: str
    temperature: float | None = _FINITE
    top_p: float | None = _FINITE
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    top_k: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    return_token_ids: bool = False  # vLLM's extra: choices carry ``token_ids``, the response ``prompt_token_ids``
    priority: int = 0  # vLLM's extra: lower first under the ``priority`` policy, else only 0 (POLICY-12)


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # SERVE-6: the top alternatives with each token's logprob (0..20)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None  # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = None
    logprobs: bool | None = None  # SERVE-6: each token's logprob...
    top_logprobs: int | None = None  # ...with this many alternatives (0..20; needs logprobs true when above 0)


def parse_body(raw: bytes) -> dict[str, Any]:
    """SERVE-15: the body as a JSON object, or a 400 saying what is wrong with it: not UTF-8 (RFC 8259; UTF-16
    and UTF-32 too), nested deeper than MAX_BODY_DEPTH, an integer past Python's digit limit, not JSON."""
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff") or b"\x00" in raw[:4]:
        raise ApiError(400, "the request body must be JSON in UTF-8; this one looks like UTF-16 or UTF-32")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body must be JSON in UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start} "
                            "is not UTF-8") from None
    if _too_deep(text):
        raise ApiError(400, f"the request body nests arrays and objects deeper than {MAX_BODY_DEPTH} levels")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except ValueError as e:  # an integer of more digits than int() converts (sys.get_int_max_str_digits)
        raise ApiError(400, f"the request body cannot be read: {str(e).split(';')[0]}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    return data


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_NESTING = {"[": 1, "{": 1, "]": -1, "}": -1}


def _too_deep(text: str) -> bool:
    """Whether ``text``'s arrays and objects nest deeper than MAX_BODY_DEPTH (brackets inside strings do not count);
    the loops run in C, a 1 MiB body of brackets in about the time ``json.loads`` takes."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_NESTING.__getitem__, brackets)), default=0) > MAX_BODY_DEPTH


def parse_request(model: type[M], raw: bytes) -> M:
    """The body as ``model``, or a 400 naming the first field at fault."""
    data = parse_body(raw)
    try:
        request = model.model_validate(data)
    except ValidationError as e:
        raise from_validation(e) from None
    if request.n != 1:
        raise ApiError(400, "n: only n=1 is supported (one completion per request)", param="n")
    if isinstance(request, ChatRequest) and request.top_logprobs and not request.logprobs:
        raise ApiError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs")
    _refuse_unsupported(data)
    return request


def _is_zero(value: object) -> bool:
    return value is None or (type(value) in (int, float) and value == 0)


# SERVE-9: OpenAI fields that would change the answer, which this server does not implement: the value that
# changes nothing (accepted), else a 400 naming the field, never a silently different answer.
_UNSUPPORTED: dict[str, tuple[str, Callable[[object], bool]]] = {
    "echo": ("false", lambda v: v is None or v is False),
    "best_of": ("null or 1", lambda v: v is None or (type(v) is int and v == 1)),
    "suffix": ("null or empty", lambda v: v is None or v == ""),
    "presence_penalty": ("0", _is_zero),
    "frequency_penalty": ("0", _is_zero),
    "logit_bias": ("null or {}", lambda v: v is None or v == {}),
    "response_format": ('{"type": "text"}', lambda v: v is None or v == {"type": "text"}),
}


def _refuse_unsupported(data: dict[str, Any]) -> None:
    for name, (default, unchanged) in _UNSUPPORTED.items():
        if name in data and not unchanged(data[name]):
            raise ApiError(400, f"{name}: not supported by this server (only {default} is accepted)", param=name)


def from_validation(error: ValidationError) -> ApiError:
    """The most telling error of ``error`` as a 400 whose message names the field's dotted path and whose param
    is that path without a trailing list index: an element of a list (``prompt: [true]``) is its list's fault,
    as the one validator names it in Python too (ARCH-6).

    For a union (``prompt``: text or token ids) the member that got furthest explains best: the deepest
    location wins, then a range error over a type error.
    """
    first = max(error.errors(include_url=False),
                key=lambda e: (len(e["loc"]), not e["type"].endswith("_type")))
    path = [p for p in first["loc"] if not _is_union_tag(p)]
    where = ".".join(map(str, path)) or "body"
    while path and isinstance(path[-1], int):
        path.pop()
    return ApiError(400, f"{where}: {first['msg']}", param=".".join(map(str, path)) or None)


def _is_union_tag(part: object) -> bool:
    """pydantic names the union member it tried (``str``, ``list[int]``...) in the location: not a field."""
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "none"} or "[" in part
                                      or part.startswith(("constrained-", "function-")))
