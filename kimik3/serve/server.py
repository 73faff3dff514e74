"""OpenAI-compatible HTTP server over any ``EngineLike`` (the engine, a replica router, a fake).

Routes: ``GET /health``, ``GET /metrics`` (no auth), ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /v1/completions``, ``POST /v1/chat/completions``. Errors use OpenAI's body
``{"error": {"message", "type", "param", "code"}}``; see ``docs/serving.md`` for the full contract.

Hostile input is refused before it costs anything: a body over ``max_request_bytes`` gets 413
before it is read whole; a prompt with more characters than the context could hold gets 400
before it is tokenised (a byte-level token covers at most ``max_token_chars`` characters); a lone
UTF-16 surrogate anywhere in the body gets 400. A request the engine fails on gets a 500 of its
own while the engine serves the others; ``/health`` answers 503 once the engine cannot serve.

Every generation runs in its own task (``_Generation``) that pumps the engine's iterator into a
queue, next to a task that watches the connection: a client that goes away, while queued or
mid-stream, cancels the pump at once, which aborts the request and closes the iterator so the
engine frees its cache. The first event is awaited before any response starts, so admission
failures (429) and too-long prompts (400) come back as plain JSON errors even for streams.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal, TypeVar

from kimik3.extras import MissingExtra, require

try:   # the [serve] extra: without it, importing this module says what to install
    from fastapi import APIRouter, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
    from pydantic_core import PydanticCustomError
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as err:
    raise MissingExtra("kimik3's HTTP server", "serve", err.name or "fastapi") from err

from kimik3.serve import chat
from kimik3.serve.metrics import RequestTrack, ServerMetrics, StatusMiddleware
from kimik3.serve.types import (AdmissionRejected, EngineLike, EngineUnavailable, GenerationRequest, RequestTooLong,
                                SamplingParams, TokenEvent, Usage)

log = logging.getLogger(__name__)
T = TypeVar("T")

ROUTES = frozenset({"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"})
OPEN_ROUTES = frozenset({"/health", "/metrics"})   # the only routes served without the API key
BODY_SLACK_BYTES = 2**20             # room for everything in a body besides the prompt
JSON_BYTES_PER_BYTE = 6              # the most JSON's escapes (\u00XX) inflate one byte of text
_SURROGATE = re.compile("[\ud800-\udfff]")   # json.loads pairs valid ones: any left is lone
DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions
OFF_LOOP_CHARS = 20_000              # inputs longer than this are tokenised off the event loop
# Accepted for compatibility only at their "off" value; anything else is a clear 400, not silence.
_OFF = (None, False, 0, [], {})
UNSUPPORTED: dict[str, tuple] = {key: _OFF for key in ("best_of", "echo", "logprobs", "top_logprobs", "suffix",
                                                        "logit_bias", "tools", "tool_choice", "functions",
                                                        "function_call", "response_format")}
# The penalties (OpenAI's presence / frequency, vLLM's repetition_penalty and min_p), passed to SamplingParams.
PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")


class APIError(Exception):
    """An error returned to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# -- request bodies -------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


def _lone_surrogate(body: Any) -> str | None:
    """The location (``messages[0].content``) of the first string or key in ``body`` holding a
    lone UTF-16 surrogate, which no tokenizer or UTF-8 writer accepts; None if there is none.
    Iterative: a deeply nested body must not exhaust the stack."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                return where or "body"
        elif isinstance(node, dict):
            for key, value in node.items():
                if isinstance(key, str) and _SURROGATE.search(key):
                    return where or "body"
                stack.append((value, f"{where}.{key}" if where else str(key)))
        elif isinstance(node, list):
            stack.extend((value, f"{where}[{i}]") for i, value in enumerate(node))
    return None


class _Body(BaseModel):
    """Fields both endpoints share. Strict: ``"5"`` is not an integer; unknown fields are kept in
    ``model_extra`` and ignored unless listed in ``UNSUPPORTED``."""

    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        where = _lone_surrogate(data)
        if where is not None:
            raise PydanticCustomError("lone_surrogate", "the text holds a lone UTF-16 surrogate (U+D800-U+DFFF), "
                                      "which is not valid Unicode", {"param": where})
        return data

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None           # extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None   # extension (vLLM's)
    min_p: float | None = None                # extension (vLLM's)
    seed: int | None = None
    stop: Any = Field(default=None, validate_default=True)   # -> list[str]
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None            # accepted, ignored

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> list[str]:
        if v is None or isinstance(v, str):
            return [] if v is None else [v]
        if not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            raise ValueError("stop must be a string or a list of strings")
        return v


class CompletionBody(_Body):
    prompt: Any

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, str) or (isinstance(v, list) and all(type(t) is int for t in v)):
            return v
        raise ValueError("only one prompt per request is supported (a string or a list of token ids); "
                         "send one request per prompt" if isinstance(v, list) else
                         "prompt must be a string or a list of token ids")


class ChatBody(_Body):
    messages: Any
    max_completion_tokens: int | None = None


# -- the engine side of one request ---------------------------------------------------------------------
class _Generation:
    """One engine request pumped by its own task, cancelled the moment the client disconnects."""

    def __init__(self, engine: EngineLike, request: GenerationRequest, http: Request, track: RequestTrack) -> None:
        self.engine, self.request, self.track = engine, request, track
        self.queue: asyncio.Queue[TokenEvent | APIError | None] = asyncio.Queue()
        self.pump = asyncio.create_task(self._pump())
        watch = asyncio.create_task(self._watch(http))
        self.pump.add_done_callback(lambda _: watch.cancel())

    async def _watch(self, http: Request) -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass
        self.pump.cancel()

    async def _pump(self) -> None:
        rid, reason, usage, finished = self.request.request_id, "abort", None, False
        it = aiter(self.engine.generate(self.request))
        try:
            async for event in it:
                if event.finish_reason == "error":   # the engine failed on this request alone
                    finished, reason, usage = True, "error", event.usage
                    self.queue.put_nowait(APIError(500, f"The engine failed on this request: {event.error}",
                                                   type="server_error"))
                    break
                self.track.event(event)
                self.queue.put_nowait(event)
                if event.finished:
                    finished, reason, usage = True, event.finish_reason or "stop", event.usage
                    break
        except AdmissionRejected as err:
            reason = "rejected"
            self.queue.put_nowait(APIError(429, f"The server is at capacity, retry later ({err})", type="requests",
                                           code="rate_limit_exceeded", headers={"Retry-After": "1"}))
        except RequestTooLong as err:
            reason = "too_long"
            self.queue.put_nowait(APIError(400, f"The request does not fit the model's context: {err}",
                                           code="context_length_exceeded"))
        except EngineUnavailable as err:
            reason = "unavailable"
            self.queue.put_nowait(APIError(503, f"The engine cannot serve: {err}", type="server_error",
                                           code="engine_unavailable"))
        except Exception as err:  # an engine bug: report it, keep serving
            log.exception("engine failed on request %s", rid)
            reason = "error"
            self.queue.put_nowait(APIError(500, f"The engine failed: {err}", type="server_error"))
        finally:
            # Bookkeeping first, without awaiting: a second cancel() must not be able to skip it.
            refused = reason in ("rejected", "too_long", "unavailable")
            if not finished and not refused:
                try:
                    self.engine.abort(rid)
                except Exception:
                    log.exception("engine.abort(%s) failed", rid)
            self.track.finish(reason, usage, admitted=not refused)
            self.queue.put_nowait(None)
            if hasattr(it, "aclose"):
                try:
                    await it.aclose()
                except Exception:
                    log.exception("closing the stream of %s failed", rid)

    async def next(self) -> TokenEvent | None:
        """The next event; ``None`` once the stream ended (finished before, or client gone)."""
        item = await self.queue.get()
        if isinstance(item, APIError):
            raise item
        return item

    def cancel(self) -> None:
        self.pump.cancel()


# -- response shapes ------------------------------------------------------------------------------------
def _usage(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}, "cost_usd": usage.cost_usd}


class _Shape:
    """Builds the JSON of one endpoint: ``text_completion`` or ``chat.completion``."""

    def __init__(self, kind: Literal["completions", "chat"], rid: str, model: str, include_usage: bool) -> None:
        self.chat, self.rid, self.model, self.include_usage = kind == "chat", rid, model, include_usage
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            body = self._head("chat.completion.chunk") | {"choices": [choice]}
        else:
            body = self._head("text_completion") | {
                "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}
        if self.include_usage:
            body["usage"] = None
        return _sse(body)

    def usage_chunk(self, usage: Usage) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return _sse(self._head(obj) | {"choices": [], "usage": _usage(usage)})

    def full(self, text: str, finish: str, usage: Usage) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
            return self._head("chat.completion") | {"choices": [choice], "usage": _usage(usage)}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self._head("text_completion") | {"choices": [choice], "usage": _usage(usage)}


def _sse(body: dict[str, Any] | str) -> bytes:
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _stream(gen: _Generation, first: TokenEvent, shape: _Shape) -> AsyncIterator[bytes]:
    """SSE body: role chunk (chat), text deltas, a finish chunk, optional usage chunk, ``[DONE]``."""
    prompt_len, tokens = len(gen.request.prompt_ids), 0
    try:
        if shape.chat:
            yield shape.chunk(None, role=True)
        event: TokenEvent | None = first
        while event is not None:
            tokens += event.token_id is not None
            if event.text:
                yield shape.chunk(event.text)
            if event.finished:
                yield shape.chunk(None, event.finish_reason)
                if shape.include_usage:
                    yield shape.usage_chunk(event.usage or Usage(prompt_len, tokens, 0))
                yield _sse("[DONE]")
                return
            event = await gen.next()
    except APIError as err:  # the engine failed mid-stream: headers are gone, say so in-band
        yield _sse(err.body())
        yield _sse("[DONE]")
    finally:
        gen.cancel()  # no-op when finished; on a disconnect this aborts the request


# -- validation helpers ---------------------------------------------------------------------------------
def _check_common(body: _Body, model_name: str) -> None:
    if body.model != model_name:
        raise APIError(404, f"The model `{body.model}` does not exist or you do not have access to it.",
                       param="model", code="model_not_found")
    if body.n not in (None, 1):
        raise APIError(400, "n > 1 is not supported: send one request per completion", param="n")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    for key, value in (body.model_extra or {}).items():
        if key in UNSUPPORTED and value not in UNSUPPORTED[key]:
            raise APIError(400, f"'{key}' is not supported by this server", param=key)


def _sampling(body: _Body, max_tokens: int, stop: list[str], max_param: str = "max_tokens") -> SamplingParams:
    defaults = SamplingParams()
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=defaults.temperature if body.temperature is None else body.temperature,
            top_p=defaults.top_p if body.top_p is None else body.top_p,
            top_k=defaults.top_k if body.top_k is None else body.top_k, seed=body.seed, stop=stop,
            **{name: getattr(body, name) for name in PENALTIES if getattr(body, name) is not None})
    except ValueError as err:
        field = str(err).split(" ", 1)[0]
        field = max_param if field == "max_tokens" else field
        raise APIError(400, str(err), param=field if field in ChatBody.model_fields else None) from None


async def _off_loop(chars: int, fn: Callable[[], T]) -> T:
    """Tokenise a long input in a worker thread: a 400K-token prompt must not stall every stream."""
    return await asyncio.to_thread(fn) if chars > OFF_LOOP_CHARS else fn()


def max_token_chars(tokenizer: Any) -> int | None:
    """The longest token of ``tokenizer``'s vocabulary (special tokens included), in characters.

    With a byte-level BPE a token string has one character per byte and a character of text takes
    at least one byte, so a text of c characters has at least c / max_token_chars tokens. None when
    the tokenizer does not expose its vocabulary (no bound is applied then)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    vocab = get_vocab(with_added_tokens=True)
    return max((len(token) for token in vocab), default=None)


def default_max_request_bytes(max_context: int, token_chars: int | None) -> int:
    """A body limit that never refuses a prompt that fits: ``max_context`` tokens of at most
    ``token_chars`` bytes each, every byte JSON-escaped, plus room for the other fields."""
    return JSON_BYTES_PER_BYTE * (token_chars or 16) * max_context + BODY_SLACK_BYTES


def _check_chars(chars: int, token_chars: int | None, max_context: int, param: str) -> None:
    """Refuse, before tokenising it, a text too long to fit the context whatever its tokens."""
    if token_chars is not None and chars > token_chars * max_context:
        raise APIError(400, f"This model's maximum context length is {max_context} tokens. However, your "
                       f"{param} has {chars:,} characters, so at least {chars // token_chars + 1:,} tokens. "
                       "Please reduce the prompt.", param=param, code="context_length_exceeded")


def _check_context(prompt_len: int, max_tokens: int, max_context: int, param: str) -> None:
    if prompt_len + max_tokens > max_context:
        raise APIError(400, f"This model's maximum context length is {max_context} tokens. However, you requested "
                       f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                       "completion). Please reduce the prompt or max_tokens.", param=param,
                       code="context_length_exceeded")


def _loc(loc: tuple[Any, ...]) -> str | None:
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    err = exc.errors()[0]
    param = _loc(tuple(err.get("loc", ())))
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if err.get("type") == "json_invalid":
        message, param = "We could not parse the JSON body of your request: it must be a JSON object.", None
    elif err.get("type") == "lone_surrogate":
        param = err.get("ctx", {}).get("param")
        message = f"Invalid value for '{param}': {msg}"
    elif param is None:
        message = f"The request body must be a JSON object ({msg})."
    elif err.get("type") == "missing":
        message = f"Missing required parameter: '{param}'."
    else:
        message = f"Invalid value for '{param}': {msg}"
    return APIError(400, message, param=param).response()


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = f"Invalid URL ({request.method} {request.url.path})" if exc.status_code == 404 else str(exc.detail)
    return APIError(exc.status_code, message, code=None).response()


class _BodyLimit:
    """Pure-ASGI limit on the request body: 413 as soon as ``Content-Length`` or the bytes received
    so far pass ``max_bytes``, so an oversized body is never held whole in memory."""

    def __init__(self, app: Callable, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _error(self, size: str) -> APIError:
        return APIError(413, f"The request body ({size}) is larger than this server's limit of {self.max_bytes:,} "
                        "bytes (kimik3 serve --max-request-bytes).", code="request_too_large")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._error(f"{length.decode(errors='replace')} bytes").response()(scope, receive, send)
            return
        received, over, answered = 0, False, False

        async def counting_receive():
            nonlocal received, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message) -> None:
            nonlocal answered
            if not over:
                await send(message)
            elif not answered:   # the app answered a truncated body: answer 413 instead
                answered = True
                await self._error(f"over {self.max_bytes:,} bytes").response()(scope, receive, send)

        await self.app(scope, counting_receive, guarded_send)
        if over and not answered:
            await self._error(f"over {self.max_bytes:,} bytes").response()(scope, receive, send)


class _BearerAuth:
    """Pure-ASGI check of ``Authorization: Bearer <key>`` on every route but ``OPEN_ROUTES``
    (``/docs`` and ``/openapi.json`` included), before the body is read."""

    def __init__(self, app: Callable, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_ROUTES:
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if not header:
                error = APIError(401, "You didn't provide an API key: send 'Authorization: Bearer <key>'.",
                                 code="invalid_api_key")
            elif scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                error = APIError(401, "Incorrect API key provided.", code="invalid_api_key")
            else:
                error = None
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


# -- the app --------------------------------------------------------------------------------------------
def create_app(engine: EngineLike, api_key: str | None = None, max_request_bytes: int | None = None) -> FastAPI:
    """The ASGI app serving ``engine``; ``api_key`` (if set) is required as a Bearer token on every
    route but /health and /metrics; ``max_request_bytes`` (default: ``default_max_request_bytes``)
    bounds a request body."""
    app = FastAPI(title="Kimi K3", summary="OpenAI-compatible completions over a kimik3 engine")
    metrics = ServerMetrics(engine)
    app.state.engine, app.state.metrics = engine, metrics
    started = int(time.time())
    vocab_size = getattr(engine.tokenizer, "get_vocab_size", lambda: None)()
    token_chars = max_token_chars(engine.tokenizer)
    if max_request_bytes is None:
        max_request_bytes = default_max_request_bytes(engine.max_context, token_chars)
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    app.state.max_request_bytes = max_request_bytes
    router = APIRouter(prefix="/v1")

    def model_card() -> dict[str, Any]:
        return {"id": engine.model_name, "object": "model", "created": started, "owned_by": "kimik3",
                "max_model_len": engine.max_context}

    @app.get("/health")
    async def health() -> JSONResponse:
        reason = engine.health()
        if reason is not None:
            return JSONResponse({"status": "unavailable", "model": engine.model_name, "error": reason},
                                status_code=503)
        stats = engine.stats()
        return JSONResponse({"status": "ok", "model": engine.model_name, "running": stats.running,
                             "waiting": stats.waiting})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=metrics.content_type)

    @router.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @router.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != engine.model_name:
            raise APIError(404, f"The model `{model_id}` does not exist or you do not have access to it.",
                           param="model", code="model_not_found")
        return model_card()

    async def run(kind: Literal["completions", "chat"], body: _Body, http: Request, arrival: float,
                  prompt_ids: list[int], hints: list[int], params: SamplingParams) -> Response:
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
        shape = _Shape(kind, rid, engine.model_name, include_usage)
        track = metrics.track(kind, arrival)
        gen = _Generation(engine, GenerationRequest(rid, prompt_ids, params, hints), http, track)
        first = await gen.next()   # raises the 429/400 before any response starts
        if first is None:
            return Response(status_code=499)  # client closed the request while it was queued
        if body.stream:
            return StreamingResponse(_stream(gen, first, shape), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        texts, event, tokens = [], first, 0
        try:
            while event is not None:
                texts.append(event.text)
                tokens += event.token_id is not None
                if event.finished:
                    usage = event.usage or Usage(len(prompt_ids), tokens, 0)
                    return JSONResponse(shape.full("".join(texts), event.finish_reason or "stop", usage))
                event = await gen.next()
        finally:
            gen.cancel()
        return Response(status_code=499)  # client gone mid-generation: nobody reads this

    @router.post("/completions")
    async def completions(body: CompletionBody, http: Request) -> Response:
        arrival = time.perf_counter()
        _check_common(body, engine.model_name)
        prompt = body.prompt
        if isinstance(prompt, str):
            _check_chars(len(prompt), token_chars, engine.max_context, "prompt")
        elif len(prompt) > engine.max_context:
            _check_context(len(prompt), 0, engine.max_context, "prompt")
        ids = (await _off_loop(len(prompt), lambda: engine.tokenizer.encode(prompt).ids)
               if isinstance(prompt, str) else list(prompt))
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt")
        if not ids:  # like OpenAI: an empty prompt means "start a new document"
            if engine.eos_token_id is None:
                raise APIError(400, "prompt must not be empty", param="prompt")
            ids = [engine.eos_token_id]
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        params = _sampling(body, max_tokens, body.stop)
        _check_context(len(ids), max_tokens, engine.max_context, "prompt")
        return await run("completions", body, http, arrival, ids, [], params)

    @router.post("/chat/completions")
    async def chat_completions(body: ChatBody, http: Request) -> Response:
        arrival = time.perf_counter()
        _check_common(body, engine.model_name)
        try:
            messages = chat.parse_messages(body.messages)
            chars = sum(len(message.content) for message in messages)
            _check_chars(chars, token_chars, engine.max_context, "messages")
            ids, hints = await _off_loop(chars, lambda: chat.encode_messages(engine.tokenizer, messages))
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from None
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = max(engine.max_context - len(ids), 1) if requested is None else requested
        stop = body.stop + [chat.CHAT_STOP] if len(body.stop) < 4 and chat.CHAT_STOP not in body.stop else body.stop
        params = _sampling(body, max_tokens, stop,
                           "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
        _check_context(len(ids), max_tokens, engine.max_context, "messages")
        return await run("chat", body, http, arrival, ids, hints, params)

    app.include_router(router)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(_BodyLimit, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(_BearerAuth, api_key=api_key)                  # before any body is read
    app.add_middleware(StatusMiddleware, metrics=metrics, routes=ROUTES)  # outermost: sees 401s too
    return app


def serve(engine: EngineLike, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          log_level: str = "info", max_request_bytes: int | None = None, health_poll_s: float = 1.0) -> int:
    """Serve ``engine`` with uvicorn until interrupted (returns 0) or until the engine can no longer
    serve (returns 1, so that a process supervisor restarts the server)."""
    require("serve", "kimik3's HTTP server", ("uvicorn",))
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(create_app(engine, api_key, max_request_bytes), host=host, port=port,
                                           log_level=log_level))
    failure: list[str] = []

    def watch() -> None:
        while not server.should_exit:
            reason = engine.health()
            if reason is not None:
                log.critical("%s: shutting the server down", reason)
                failure.append(reason)
                server.should_exit = True
                return
            time.sleep(health_poll_s)

    threading.Thread(target=watch, name="engine-health", daemon=True).start()
    server.run()
    return 1 if failure else 0
