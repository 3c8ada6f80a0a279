"""The HTTP side: OpenAI's endpoints over an ``EngineHandle`` (spec/serve.md).

Invariants: the key is checked first, for every /v1 path (``KeyCheck``,
SERVE-11); a handler checks the body's shape (protocol.py), then the request in
full with the one validator (``entry.requests.validated_request``: the rules
``LLM`` applies, ARCH-6), builds its ``SamplingParams`` once and submits
nothing before (SERVE-9), so a refused request changes nothing; a
``RequestRefused`` becomes a 400 by its ``field``, ``reason`` and ``code``
(``param: reason``, ``param`` the body's name for the field), never by its
text; the engine process takes the request as validated. Every error is
OpenAI's JSON with a status that says whose fault it is (400 bad input, 401
key, 404 model or path, 413 body, 503 not admitting, 500 engine failure). Text
reaches the client only through ``IncrementalDetokenizer`` (whole characters,
never a possible stop string's beginning), and the streamed pieces add up to
the non-streamed text; a stream sends nothing before the first output, then a
chunk per engine step, empty while its text is held (SERVE-17). A handler that
ends before its request finished (the client went away, SERVE-7) cancels it in
``finally``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from optimized.engine.detokenizer import IncrementalDetokenizer
from optimized.engine.sampling_params import Logprob, SamplingParams
from optimized.engine.validation import RequestRefused
from optimized.entry.requests import trace_check, validated_request
from optimized.models.tokenizer import load_tokenizer
from optimized.serve.chat import ChatTemplate
from optimized.serve.logprobs import LogprobsWire
from optimized.serve.loop import (
    EngineHandle,
    EngineInfo,
    Event,
    FailEvent,
    FinishEvent,
    Stream,
    TokenEvent,
    Unavailable,
)
from optimized.serve.metrics import Metrics
from optimized.serve.protocol import ApiError, ChatRequest, CompletionRequest, parse_request

MAX_BODY_BYTES = 1 << 20  # SERVE-9: 1 MiB holds a 4096-token prompt as ids many times over


@dataclass
class ServerOptions:
    served_model: str = "default"
    other_names: tuple[str, ...] = ()  # SERVE-22: more names a request's model may give (/v1/models lists them)
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    stream_interval: int = 1  # SERVE-4: a streamed chunk once this many tokens wait (the first token at once)


@dataclass
class Lifecycle:
    """What the server is doing, for /health and admission; ``handlers`` counts requests being answered."""

    draining: bool = False
    handlers: int = 0
    created: int = field(default_factory=lambda: int(time.time()))


class BodyLimit:
    """SERVE-9: a body over ``limit`` bytes is a 413, by its Content-Length or as it streams in."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await JSONResponse(self._error().body(), 413)(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise self._error()
            return message

        await self.app(scope, limited, send)

    def _error(self) -> ApiError:
        return ApiError(413, f"the request body is larger than the server's limit of {self.limit} bytes",
                        code="request_too_large")


class KeyCheck:
    """SERVE-11: with a key set, every path under /v1 needs ``Authorization: Bearer KEY`` or is a 401, before
    anything else (an unknown path's 404, a wrong method's 405, a body's 413). The header's raw bytes are
    compared, in constant time."""

    def __init__(self, app: ASGIApp, key: bytes | None) -> None:
        self.app = app
        self.key = key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._refused(scope):
            error = ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key")
            await _error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refused(self, scope: Scope) -> bool:
        if self.key is None or scope["type"] != "http" or not _under_v1(scope["path"]):
            return False
        scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        return scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(b" \t"), self.key)


def _under_v1(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def _error_response(error: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error.body(), error.status, headers=headers)


def build_app(info: EngineInfo, loop: EngineHandle, metrics: Metrics, template: ChatTemplate,
              options: ServerOptions, lifecycle: Lifecycle | None = None) -> FastAPI:
    """The FastAPI app over the engine ``info`` describes; its lifespan starts ``loop`` (unless started) and
    stops it at shutdown."""
    life = lifecycle or Lifecycle()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loop.start()
        yield
        life.draining = True
        await asyncio.to_thread(loop.stop)

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=options.max_body_bytes)
    app.add_middleware(KeyCheck, key=options.api_key.encode("ascii") if options.api_key else None)  # outermost
    handler = _Handlers(info, loop, metrics, template, options, life)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        return _error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _error_response(ApiError(error.status_code, str(error.detail), kind=kind))

    app.add_api_route("/health", handler.health, methods=["GET"])
    app.add_api_route("/metrics", handler.metrics_text, methods=["GET"])
    app.add_api_route("/v1/models", handler.models, methods=["GET"])
    app.add_api_route("/v1/completions", handler.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", handler.chat, methods=["POST"])
    return app


class _Handlers:
    def __init__(self, info: EngineInfo, loop: EngineHandle, metrics: Metrics, template: ChatTemplate,
                 options: ServerOptions, life: Lifecycle) -> None:
        self.limits = info.limits
        self.check_add = trace_check(info.traced)
        self.tokenizer = load_tokenizer(info.model_dir)
        self.loop = loop
        self.metrics = metrics
        self.template = template
        self.options = options
        self.life = life

    # --- plain endpoints --------------------------------------------------------------------------
    async def health(self, request: Request) -> JSONResponse:
        """SERVE-12: 200 only while the engine loop runs, trusted, and the server admits requests."""
        status = self._status()
        body: dict[str, Any] = {"status": status}
        if status == "ok" and request.query_params.get("verbose") in ("1", "true"):
            try:
                state = await asyncio.wrap_future(self.loop.engine_state())
            except Unavailable as e:  # the loop stopped or failed since (or the server began to shut down)
                status = self._status()
                return JSONResponse({"status": status if status != "ok" else f"failed: {e}"}, 503)
            body["engine"] = dataclasses.asdict(state)
        return JSONResponse(body, 200 if status == "ok" else 503)

    def _status(self) -> str:
        if self.loop.failure is not None:
            return f"failed: {self.loop.failure}"
        if not self.loop.alive():
            return "failed: the engine loop is not running"
        return "shutting down" if self.life.draining else "ok"

    async def metrics_text(self) -> Response:
        return Response(self.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": self.life.created, "owned_by": "nanoverify",
             "max_model_len": self.limits.max_model_len} for name in (self.options.served_model,
                                                                      *self.options.other_names)]})

    # --- generation -------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body = parse_request(CompletionRequest, await self._admitted_body(request))
        self._check_model(body.model)
        call = _Call("text_completion", body.stream, body, "prompt", "max_tokens")
        if body.logprobs is not None:
            call.logprobs = LogprobsWire(self.tokenizer, body.logprobs)
        return await self._generate(request, call, body.prompt, body.max_tokens)

    async def chat(self, request: Request) -> Response:
        body = parse_request(ChatRequest, await self._admitted_body(request))
        self._check_model(body.model)
        try:
            text = self.template.render([{"role": m.role, "content": m.text()} for m in body.messages])
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        given = body.max_completion_tokens is not None
        if given and body.max_tokens is not None and body.max_tokens != body.max_completion_tokens:
            raise ApiError(400, f"max_tokens: set one of max_tokens and max_completion_tokens (here "
                                f"{body.max_tokens} and {body.max_completion_tokens})", param="max_tokens")
        limit_field = "max_completion_tokens" if given else "max_tokens"
        call = _Call("chat.completion", body.stream, body, "messages", limit_field)
        if body.logprobs:
            call.logprobs = LogprobsWire(self.tokenizer, body.top_logprobs or 0)
        return await self._generate(request, call, text, body.max_completion_tokens if given else body.max_tokens)

    async def _admitted_body(self, request: Request) -> bytes:
        if self.life.draining or self.loop.failure is not None:
            raise ApiError(503, self._status(), kind="service_unavailable")
        return await request.body()

    def _check_model(self, model: str) -> None:
        if model != self.options.served_model and model not in self.options.other_names:
            raise ApiError(404, f"model: the server serves {self.options.served_model!r}, not {model!r}",
                           param="model", code="model_not_found", kind="not_found_error")

    def _validated(self, call: _Call, prompt: str | list[int],
                   max_tokens: int | None) -> tuple[list[int], SamplingParams, int]:
        """SERVE-9, ARCH-6: the prompt's ids, the request's ``SamplingParams`` and its priority (POLICY-12), or the
        one validator's refusal as a 400. A max_tokens left to the server is all the room the limits leave."""
        sampling = _sampling(call.body)

        def params(prompt_len: int) -> SamplingParams:
            return SamplingParams(**sampling, max_tokens=self.limits.room(prompt_len) if max_tokens is None
                                  else max_tokens)

        try:
            return validated_request(prompt, params, self.limits, self.tokenizer, self.check_add, call.body.priority)
        except RequestRefused as refusal:
            raise call.refused(refusal) from None

    async def _generate(self, request: Request, call: _Call, prompt: str | list[int],
                        max_tokens: int | None) -> Response:
        ids, params, priority = self._validated(call, prompt, max_tokens)
        stream = Stream(ids, params, asyncio.get_running_loop(), priority=priority)
        try:
            self.loop.submit(stream)
        except Unavailable as e:
            raise ApiError(503, str(e), kind="service_unavailable") from None
        call.prompt_tokens = len(ids)
        call.prompt_ids = ids
        if call.streaming:
            events = self._sse(stream, call)
            # A client gone before the body starts leaves the generator unstarted, so its ``finally`` never
            # runs: cancelling when the generator is collected covers that case too (cancel is idempotent).
            weakref.finalize(events, self.loop.cancel, stream)
            return StreamingResponse(events, media_type="text/event-stream")
        return await self._whole(request, stream, call)

    async def _whole(self, request: Request, stream: Stream, call: _Call) -> JSONResponse:
        """A non-streamed answer; a client that disconnects while waiting cancels its request (SERVE-7)."""
        self.life.handlers += 1
        timing = _Timing(self.metrics, stream)
        waiter = asyncio.ensure_future(self._finish(stream, timing))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not waiter.done():
                raise ApiError(499, "the client closed the connection")
            event = waiter.result()
        finally:
            self.life.handlers -= 1
            gone.cancel()
            if not waiter.done():
                waiter.cancel()
                self.loop.cancel(stream)
        if isinstance(event, FailEvent):
            raise _failure(event)
        output = event.output
        if output.finish_reason == "error":
            raise ApiError(500, "the model failed during this request's step", kind="server_error")
        return JSONResponse(call.whole(self.options.served_model, output.text, output.finish_reason,
                                       output.token_ids, output.logprobs))

    async def _finish(self, stream: Stream, timing: _Timing) -> FinishEvent | FailEvent:
        while True:
            event = await stream.queue.get()
            if isinstance(event, TokenEvent):
                timing.tokens(event)
            else:
                if isinstance(event, FinishEvent):
                    timing.finish(event)
                return event

    async def _sse(self, stream: Stream, call: _Call) -> AsyncIterator[str]:
        """SERVE-4, SERVE-17: Server-Sent Events as vLLM sends them: nothing before the first output (chat's role
        chunk goes with it), then a chunk per engine step (per ``stream_interval`` steps), its text empty while
        nothing can be released; cancelled by a disconnect (SERVE-7)."""
        self.life.handlers += 1
        model = self.options.served_model
        detokenizer = IncrementalDetokenizer(self.tokenizer, stream.params.stop)
        timing = _Timing(self.metrics, stream)
        ended = False
        role_due = call.kind == "chat.completion"  # chat's first chunk names the role, with the first output
        pending: list[int] = []  # tokens whose chunk is not sent yet
        pending_logprobs: list[dict[int, Logprob]] = []  # theirs, when asked (SERVE-6)
        chunks = 0  # content chunks sent
        try:
            while not ended:
                event: Event = await stream.queue.get()
                while isinstance(event, TokenEvent):  # every step's tokens that are here: one chunk for all
                    timing.tokens(event)
                    detokenizer.add(event.tokens)
                    pending += event.tokens
                    pending_logprobs += event.logprobs or []
                    if stream.queue.empty():
                        break
                    event = stream.queue.get_nowait()
                if isinstance(event, TokenEvent):
                    if len(pending) < self.options.stream_interval and chunks:
                        continue  # fewer tokens than the interval: they go with the next chunk
                    if role_due:
                        yield call.chunk(model, None, None, role=True)
                        role_due = False
                    yield call.chunk(model, detokenizer.take(), None, token_ids=pending, logprobs=pending_logprobs)
                    pending, pending_logprobs = [], []
                    chunks += 1
                    continue
                ended = True
                if isinstance(event, FailEvent):
                    yield _sse_data(_failure(event).body())
                elif event.output.finish_reason == "error":
                    yield _sse_data(ApiError(500, "the model failed during this request's step",
                                             kind="server_error").body())
                else:
                    timing.finish(event)
                    if role_due:
                        yield call.chunk(model, None, None, role=True)
                    yield call.chunk(model, detokenizer.take_final(), event.output.finish_reason, token_ids=pending,
                                     logprobs=pending_logprobs)
                    if call.include_usage:
                        yield call.usage_chunk(model, len(event.output.token_ids))
                yield "data: [DONE]\n\n"
        finally:
            self.life.handlers -= 1
            if not ended:
                self.loop.cancel(stream)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (its body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _failure(event: FailEvent) -> ApiError:
    """The loop's failure as an error whose type follows its status."""
    return ApiError(event.status, event.message,
                    kind="server_error" if event.status >= 500 else "invalid_request_error")


def _sampling(body: CompletionRequest | ChatRequest) -> dict[str, Any]:
    """The body's sampling fields as ``SamplingParams`` arguments; those it left out take its defaults."""
    given = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
             "stop": body.stop,
             # SERVE-6: completions' logprobs count; chat's top_logprobs when logprobs is true
             "logprobs": body.logprobs if isinstance(body, CompletionRequest)
             else (body.top_logprobs or 0) if body.logprobs else None}
    return {**{name: value for name, value in given.items() if value is not None}, "ignore_eos": body.ignore_eos,
            "stop_token_ids": tuple(body.stop_token_ids)}


def _sse_data(payload: dict[str, Any]) -> str:
    import json

    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _Timing:
    """The request histograms of one request, observed as its events arrive (SERVE-13)."""

    def __init__(self, metrics: Metrics, stream: Stream) -> None:
        self.metrics = metrics
        self.stream = stream
        self.arrived = stream.arrived
        self.last: float | None = None

    def tokens(self, event: TokenEvent) -> None:
        m = self.metrics
        if self.last is None:
            m.ttft.observe(event.at - self.arrived)
            # when a step first computed it (a chunked prompt's first chunk), as the loop noted it
            m.queue_time.observe(max(0.0, event.scheduled - self.arrived))
        else:
            m.itl.observe(event.at - self.last)
        self.last = event.at

    def finish(self, event: FinishEvent) -> None:
        self.metrics.e2e.observe(event.at - self.arrived)


class _Call:
    """One request's response shapes (completion or chat, streamed or whole)."""

    def __init__(self, kind: str, streaming: bool, body: CompletionRequest | ChatRequest, prompt_field: str,
                 limit_field: str) -> None:
        self.kind = kind
        self.streaming = streaming
        self.body = body
        # The body's names for SamplingParams' fields: "prompt" or "messages"; "max_tokens" or
        # "max_completion_tokens".
        self.wire_names = {"prompt": prompt_field, "max_tokens": limit_field,
                           "logprobs": "top_logprobs" if kind == "chat.completion" else "logprobs"}
        self.logprobs: LogprobsWire | None = None  # SERVE-6: asked
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.id = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_tokens = 0
        self.prompt_ids: list[int] = []

    def refused(self, refusal: RequestRefused) -> ApiError:
        """ARCH-6: a refusal as a 400 whose ``param`` is the body's name for its field, said before its reason."""
        param = self.wire_names.get(refusal.field, refusal.field)
        return ApiError(400, f"{param}: {refusal.reason}", param=param, code=refusal.code)

    def _usage(self, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None) -> dict[str, Any] | None:
        if self.logprobs is None or logprobs is None:
            return None
        if self.kind == "chat.completion":
            return self.logprobs.content(token_ids, logprobs)
        return self.logprobs.legacy(token_ids, logprobs)

    def whole(self, model: str, text: str, finish_reason: str, token_ids: list[int],
              logprobs: list[dict[int, Logprob]] | None = None) -> dict[str, Any]:
        wire = self._logprobs(token_ids, logprobs)
        if self.kind == "chat.completion":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": wire, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": wire, "finish_reason": finish_reason}
        response = {"id": self.id, "object": self.kind, "created": self.created, "model": model,
                    "choices": [choice], "usage": self._usage(len(token_ids))}
        if self.body.return_token_ids:
            choice["token_ids"] = token_ids
            response["prompt_token_ids"] = self.prompt_ids
        return response

    def chunk(self, model: str, text: str | None, finish_reason: str | None, role: bool = False,
              token_ids: list[int] | None = None, logprobs: list[dict[int, Logprob]] | None = None) -> str:
        wire = self._logprobs(token_ids or [], logprobs) if logprobs else None
        if self.kind == "chat.completion":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
            if finish_reason is not None and not text:
                delta = {}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": wire, "finish_reason": finish_reason}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": wire, "finish_reason": finish_reason}
            kind = "text_completion"
        if self.body.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        payload: dict[str, Any] = {"id": self.id, "object": kind, "created": self.created, "model": model,
                                   "choices": [choice]}
        if self.include_usage:
            payload["usage"] = None
        return _sse_data(payload)

    def usage_chunk(self, model: str, completion_tokens: int) -> str:
        kind = "chat.completion.chunk" if self.kind == "chat.completion" else "text_completion"
        return _sse_data({"id": self.id, "object": kind, "created": self.created, "model": model, "choices": [],
                          "usage": self._usage(completion_tokens)})

