"""OpenAI-compatible HTTP server over any ``EngineLike`` (the engine, a replica router, a fake).

Routes: ``GET /health``, ``GET /metrics`` (no auth), ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /v1/completions``, ``POST /v1/chat/completions``. Errors use OpenAI's body
``{"error": {"message", "type", "param", "code"}}``; see ``docs/serving.md`` for the full contract.
This module is the HTTP side (the app, its routes and middleware, the engine requests behind a
request); ``openai_protocol.py`` holds the bodies, their validation and the JSON answered.

Hostile input is refused before it costs anything: a body over ``max_request_bytes`` gets 413
before it is read whole; a prompt with more characters than the context could hold gets 400
before it is tokenised (a byte-level token covers at most ``max_token_chars`` characters); a lone
UTF-16 surrogate anywhere in the body gets 400. A request the engine fails on gets a 500 of its
own while the engine serves the others; ``/health`` answers 503 once the engine cannot serve.

A request with ``n`` choices is ``n`` engine requests (``<id>-<i>`` when n > 1), each pumped by its
own task into one queue (``_Generation``), next to one task that watches the connection: a client
that goes away, while queued or mid-stream, cancels every pump at once, which aborts the requests
and closes their iterators so the engine frees their cache. The first event of every choice is
awaited before any response starts, so admission failures (429) and too-long prompts (400) come
back as plain JSON errors even for streams. A choice the engine fails on ends the whole request
the way a single choice's failure does (500, or an in-band error mid-stream); the others are aborted.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal, TypeVar

from kimik3.extras import MissingExtra, require

try:   # the [serve] extra: without it, importing this module says what to install
    from fastapi import APIRouter, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as err:
    raise MissingExtra("kimik3's HTTP server", "serve", err.name or "fastapi") from err

from kimik3.serve import chat
from kimik3.serve.images import ImageError, ImageLimits, ImageRule, PreparedImage, load_image_url
from kimik3.serve.metrics import RequestTrack, ServerMetrics, StatusMiddleware
from kimik3.serve.openai_protocol import (DEFAULT_COMPLETION_MAX_TOKENS, PENALTIES, UNSUPPORTED, APIError, ChatBody,
                                          CompletionBody, Shape, StreamOptions, TokenStrings, _Body, api_error,
                                          check_chars, check_common, check_context, http_error, sampling_params,
                                          sse, validation_error)
from kimik3.serve.types import (AdmissionRejected, EngineLike, EngineUnavailable, GenerationRequest, RequestTooLong,
                                SamplingParams, TokenEvent)

__all__ = ["APIError", "BODY_SLACK_BYTES", "ChatBody", "CompletionBody", "DEFAULT_COMPLETION_MAX_TOKENS",
           "JSON_BYTES_PER_BYTE", "OFF_LOOP_CHARS", "OPEN_ROUTES", "PENALTIES", "ROUTES", "StreamOptions",
           "UNSUPPORTED", "create_app", "default_max_request_bytes", "max_token_chars", "serve"]

log = logging.getLogger(__name__)
T = TypeVar("T")

ROUTES = frozenset({"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"})
OPEN_ROUTES = frozenset({"/health", "/metrics"})   # the only routes served without the API key
BODY_SLACK_BYTES = 2**20             # room for everything in a body besides the prompt
JSON_BYTES_PER_BYTE = 6              # the most JSON's escapes (\u00XX) inflate one byte of text
OFF_LOOP_CHARS = 20_000              # inputs longer than this are tokenised off the event loop


# -- the engine side of one request ---------------------------------------------------------------------
class _Generation:
    """The engine requests of one HTTP request (its choices), each pumped by its own task into one queue,
    all cancelled the moment the client disconnects."""

    def __init__(self, engine: EngineLike, requests: list[GenerationRequest], http: Request,
                 tracks: list[RequestTrack]) -> None:
        self.engine = engine
        self.queue: asyncio.Queue[tuple[int, TokenEvent | APIError | None]] = asyncio.Queue()
        self.ready: deque[tuple[int, TokenEvent | APIError | None]] = deque()   # read by start(), not yet by next()
        self.finished: set[int] = set()
        self.pumps = [asyncio.create_task(self._pump(i, request, track))
                      for i, (request, track) in enumerate(zip(requests, tracks, strict=True))]
        self.live = len(self.pumps)
        watch = asyncio.create_task(self._watch(http))

        def pump_done(_: asyncio.Task) -> None:
            self.live -= 1
            if not self.live:
                watch.cancel()

        for pump in self.pumps:
            pump.add_done_callback(pump_done)

    async def _watch(self, http: Request) -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass
        self.cancel()

    async def _pump(self, index: int, request: GenerationRequest, track: RequestTrack) -> None:
        rid, reason, usage, finished = request.request_id, "abort", None, False

        def put(item: TokenEvent | APIError | None) -> None:
            self.queue.put_nowait((index, item))

        it = aiter(self.engine.generate(request))
        try:
            async for event in it:
                if event.finish_reason == "error":   # the engine failed on this request alone
                    finished, reason, usage = True, "error", event.usage
                    put(APIError(500, f"The engine failed on this request: {event.error}", type="server_error"))
                    break
                track.event(event)
                put(event)
                if event.finished:
                    finished, reason, usage = True, event.finish_reason or "stop", event.usage
                    break
        except AdmissionRejected as err:
            reason = "rejected"
            put(APIError(429, f"The server is at capacity, retry later ({err})", type="requests",
                         code="rate_limit_exceeded", headers={"Retry-After": "1"}))
        except RequestTooLong as err:
            reason = "too_long"
            put(APIError(400, f"The request does not fit the model's context: {err}", code="context_length_exceeded"))
        except EngineUnavailable as err:
            reason = "unavailable"
            put(APIError(503, f"The engine cannot serve: {err}", type="server_error", code="engine_unavailable"))
        except Exception as err:  # an engine bug: report it, keep serving
            log.exception("engine failed on request %s", rid)
            reason = "error"
            put(APIError(500, f"The engine failed: {err}", type="server_error"))
        finally:
            # Bookkeeping first, without awaiting: a second cancel() must not be able to skip it.
            refused = reason in ("rejected", "too_long", "unavailable")
            if not finished and not refused:
                try:
                    self.engine.abort(rid)
                except Exception:
                    log.exception("engine.abort(%s) failed", rid)
            track.finish(reason, usage, admitted=not refused)
            put(None)
            if hasattr(it, "aclose"):
                try:
                    await it.aclose()
                except Exception:
                    log.exception("closing the stream of %s failed", rid)

    async def start(self) -> bool:
        """Wait for the first event of every choice, raising the first error (429, 400, ...) before any
        response starts; False if the client went away meanwhile."""
        started: set[int] = set()
        while len(started) < len(self.pumps):
            index, item = await self.queue.get()
            if isinstance(item, APIError):
                self.cancel()
                raise item
            if item is None:
                if index in started:   # that choice's stream ended after it finished
                    continue
                return False           # cancelled before its first event: the client is gone
            started.add(index)
            self.ready.append((index, item))
        return True

    async def next(self) -> tuple[int, TokenEvent] | None:
        """The next event of any choice, as ``(choice index, event)``; None once every choice finished,
        or when the streams ended early (client gone). Raises the APIError of a choice that failed."""
        while len(self.finished) < len(self.pumps):
            index, item = self.ready.popleft() if self.ready else await self.queue.get()
            if item is None:
                if index in self.finished:
                    continue
                return None
            if isinstance(item, APIError):
                raise item
            if item.finished:
                self.finished.add(index)
            return index, item
        return None

    def cancel(self) -> None:
        for pump in self.pumps:
            pump.cancel()


async def _stream(gen: _Generation, shape: Shape) -> AsyncIterator[bytes]:
    """SSE body: role chunks (chat), every choice's text deltas and finish chunk as they come, an optional
    usage chunk, ``[DONE]``."""
    try:
        if shape.chat:
            yield shape.opening()
        while (item := await gen.next()) is not None:
            yield shape.stream(*item)
        if shape.done:
            if shape.include_usage:
                yield shape.usage_chunk()
            yield sse("[DONE]")
    except APIError as err:  # the engine failed mid-stream: headers are gone, say so in-band
        yield sse(err.body())
        yield sse("[DONE]")
    finally:
        gen.cancel()  # no-op when finished; on a disconnect this aborts the requests


# -- images --------------------------------------------------------------------------------------------
class _ImageLoader:
    """A chat request's ``image_url`` parts -> ``PreparedImage`` s under the engine's ``ImageRule``, off the event
    loop; every refusal a 400 naming the part (``kimik3.serve.images``)."""

    def __init__(self, engine: EngineLike, encoder: chat.ChatEncoder, limits: ImageLimits) -> None:
        self.rule: ImageRule | None = getattr(engine, "image_rule", None)
        self.limits = limits
        self.refusal: str | None = None
        if self.rule is None:
            self.refusal = "this model has no vision tower: image_url content parts are not accepted"
        elif encoder.media_ids is None or encoder.media_ids[1] != self.rule.image_token_id:
            self.refusal = (f"this model's tokenizer does not hold its image placeholder (<|media_pad|> as token "
                            f"{self.rule.image_token_id}): image_url content parts are not accepted")
            log.warning("%s", self.refusal)

    async def load(self, parts: list[chat.ImagePart]) -> list[PreparedImage]:
        if not parts:
            return []
        if self.refusal is not None:
            raise APIError(400, self.refusal, param=parts[0].where, code="image_not_supported")
        if len(parts) > self.limits.max_images:
            raise APIError(400, f"the request holds {len(parts)} images; this server takes at most "
                           f"{self.limits.max_images}", param=parts[self.limits.max_images].where,
                           code="invalid_image")
        return await asyncio.to_thread(self._load_all, parts)

    def _load_all(self, parts: list[chat.ImagePart]) -> list[PreparedImage]:
        out = []
        for part in parts:
            try:
                out.append(load_image_url(part.url, self.rule, self.limits))
            except ImageError as err:
                raise APIError(400, f"Invalid image: {err}", param=part.where, code="invalid_image") from None
            except MissingExtra as err:
                raise APIError(500, str(err), type="server_error") from None
        return out


# -- limits and middleware -----------------------------------------------------------------------------
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
def create_app(engine: EngineLike, api_key: str | None = None, max_request_bytes: int | None = None,
               chat_template: chat.ChatTemplate | None = None, image_limits: ImageLimits | None = None) -> FastAPI:
    """The ASGI app serving ``engine``; ``api_key`` (if set) is required as a Bearer token on every
    route but /health and /metrics; ``max_request_bytes`` (default: ``default_max_request_bytes``)
    bounds a request body; ``chat_template`` renders chat messages (default: the built-in one);
    ``image_limits`` bounds the images of a chat request (``kimik3.serve.images``)."""
    app = FastAPI(title="Kimi K3", summary="OpenAI-compatible completions over a kimik3 engine")
    metrics = ServerMetrics(engine)
    app.state.engine, app.state.metrics = engine, metrics
    started = int(time.time())
    vocab_size = getattr(engine.tokenizer, "get_vocab_size", lambda: None)()
    token_chars = max_token_chars(engine.tokenizer)
    strings = TokenStrings(engine.tokenizer)   # token ids -> text for log-probabilities
    chat_encoder = chat.ChatEncoder(engine.tokenizer, chat_template)
    if chat_encoder.plain_markers:
        log.warning("the chat template's markers %s are not special tokens of this tokenizer (its vocabulary "
                    "has no room for them): they are encoded as plain text", ", ".join(chat_encoder.plain_markers))
    images = _ImageLoader(engine, chat_encoder, image_limits or ImageLimits())
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
                  prompt_ids: list[int], hints: list[int], params: list[SamplingParams],
                  images: list[PreparedImage] | None = None) -> Response:
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
        shape = Shape(kind, rid, engine.model_name, len(params), len(prompt_ids), params[0].logprobs, strings,
                      include_usage)
        ids = [rid] if len(params) == 1 else [f"{rid}-{i}" for i in range(len(params))]
        requests = [GenerationRequest(i, prompt_ids, p, hints, list(images or ())) for i, p in zip(ids, params)]
        gen = _Generation(engine, requests, http,
                          [metrics.track(kind, arrival) for _ in params])
        streaming = False
        try:
            if not await gen.start():   # raises the 429/400 before any response starts
                return Response(status_code=499)  # client closed the request while it was queued
            if body.stream:
                streaming = True   # _stream owns the generation from here
                return StreamingResponse(_stream(gen, shape), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            while (item := await gen.next()) is not None:
                shape.add(*item)
            if shape.done:
                return JSONResponse(shape.full())
            return Response(status_code=499)  # client gone mid-generation: nobody reads this
        finally:
            if not streaming:
                gen.cancel()

    @router.post("/completions")
    async def completions(body: CompletionBody, http: Request) -> Response:
        arrival = time.perf_counter()
        check_common(body, engine.model_name)
        prompt = body.prompt
        if isinstance(prompt, str):
            check_chars(len(prompt), token_chars, engine.max_context, "prompt")
        elif len(prompt) > engine.max_context:
            check_context(len(prompt), 0, engine.max_context, "prompt")
        ids = (await _off_loop(len(prompt), lambda: engine.tokenizer.encode(prompt).ids)
               if isinstance(prompt, str) else list(prompt))
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt")
        if not ids:  # like OpenAI: an empty prompt means "start a new document"
            if engine.eos_token_id is None:
                raise APIError(400, "prompt must not be empty", param="prompt")
            ids = [engine.eos_token_id]
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        params = sampling_params(body, max_tokens, body.stop, body.logprobs_asked())
        check_context(len(ids), max_tokens, engine.max_context, "prompt")
        return await run("completions", body, http, arrival, ids, [], params)

    @router.post("/chat/completions")
    async def chat_completions(body: ChatBody, http: Request) -> Response:
        arrival = time.perf_counter()
        check_common(body, engine.model_name)
        try:
            messages = chat.parse_messages(body.messages)
            chars = sum(len(message.content) for message in messages)
            check_chars(chars, token_chars, engine.max_context, "messages")
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from None
        prepared = await images.load([part for message in messages for part in message.images])
        try:
            ids, hints = await _off_loop(chars, lambda: chat_encoder.encode(
                messages, image_tokens=[image.num_tokens for image in prepared]))
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from None
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = max(engine.max_context - len(ids), 1) if requested is None else requested
        # The end of an assistant turn: its token when the template's marker is a special token, else the marker
        # as a stop string when the client left room for it.
        end, end_ids = chat_encoder.stop, chat_encoder.stop_token_ids
        stop = body.stop + [end] if end and not end_ids and len(body.stop) < 4 and end not in body.stop else body.stop
        params = sampling_params(body, max_tokens, stop, body.logprobs_asked(),
                                 "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
                                 end_ids)
        check_context(len(ids), max_tokens, engine.max_context, "messages")
        return await run("chat", body, http, arrival, ids, hints, params, prepared)

    app.include_router(router)
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_middleware(_BodyLimit, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(_BearerAuth, api_key=api_key)                  # before any body is read
    app.add_middleware(StatusMiddleware, metrics=metrics, routes=ROUTES)  # outermost: sees 401s too
    return app


def serve(engine: EngineLike, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          log_level: str = "info", max_request_bytes: int | None = None, health_poll_s: float = 1.0,
          chat_template: chat.ChatTemplate | None = None) -> int:
    """Serve ``engine`` with uvicorn until interrupted (returns 0) or until the engine can no longer
    serve (returns 1, so that a process supervisor restarts the server)."""
    require("serve", "kimik3's HTTP server", ("uvicorn",))
    import uvicorn

    app = create_app(engine, api_key, max_request_bytes, chat_template)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
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
