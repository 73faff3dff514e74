"""The OpenAI protocol of the HTTP server: request bodies, their validation, and the JSON it answers.

Nothing here touches the network or the engine: ``server.py`` parses a body into ``CompletionBody`` or
``ChatBody``, checks it (``check_common``, ``check_chars``, ``check_context``), turns it into one
``SamplingParams`` per choice (``sampling_params``), and feeds the engine's events to a ``Shape``, which
builds the SSE chunks or the full response of the endpoint: ``text_completion`` or ``chat.completion``,
with ``n`` choices and, when asked, their tokens' log-probabilities. Errors are ``APIError`` s, rendered
in OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from typing import Any, Literal

from kimik3.extras import MissingExtra

try:   # the [serve] extra, as in server.py
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
    from pydantic_core import PydanticCustomError
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as err:
    raise MissingExtra("kimik3's HTTP server", "serve", err.name or "fastapi") from err

from kimik3.serve.types import MAX_LOGPROBS, SEED_RANGE, SamplingParams, TokenEvent, Usage

DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions
MAX_CHOICES = 16                     # the largest n: each choice is a sequence of its own in the engine
NO_LOGPROB = -9999.0                 # what OpenAI reports for a log-probability of -inf (JSON has no infinity)
_SURROGATE = re.compile("[\ud800-\udfff]")   # json.loads pairs valid ones: any left is lone
# Accepted for compatibility only at their "off" value; anything else is a clear 400, not silence.
_OFF = (None, False, 0, [], {})
UNSUPPORTED: dict[str, tuple] = {key: _OFF for key in ("echo", "top_logprobs", "suffix", "logit_bias", "tools",
                                                        "tool_choice", "functions", "function_call",
                                                        "response_format")}
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
    ignore_eos: bool | None = None            # extension (vLLM's)
    min_tokens: int | None = None             # extension (vLLM's)
    seed: int | None = None
    stop: Any = Field(default=None, validate_default=True)   # -> list[str]
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    best_of: int | None = None         # only n (or null): no extra candidates are generated
    user: str | None = None            # accepted, ignored

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> list[str]:
        if v is None or isinstance(v, str):
            return [] if v is None else [v]
        if not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            raise ValueError("stop must be a string or a list of strings")
        return v

    @property
    def choices(self) -> int:
        return 1 if self.n is None else self.n


class CompletionBody(_Body):
    prompt: Any
    logprobs: int | None = None        # the log-probabilities of each token and of this many alternatives

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, str) or (isinstance(v, list) and all(type(t) is int for t in v)):
            return v
        raise ValueError("only one prompt per request is supported (a string or a list of token ids); "
                         "send one request per prompt" if isinstance(v, list) else
                         "prompt must be a string or a list of token ids")

    def logprobs_asked(self) -> int | None:
        """SamplingParams.logprobs: None (off) or how many alternatives per token."""
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}",
                           param="logprobs")
        return self.logprobs


class ChatBody(_Body):
    messages: Any
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def logprobs_asked(self) -> int | None:
        """SamplingParams.logprobs: None (off) or how many alternatives per token."""
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top}",
                           param="top_logprobs")
        if not self.logprobs:
            if top:   # 0 is its off value, as in vLLM
                raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        return top or 0


# -- validation -----------------------------------------------------------------------------------------
def check_common(body: _Body, model_name: str) -> None:
    if body.model != model_name:
        raise APIError(404, f"The model `{body.model}` does not exist or you do not have access to it.",
                       param="model", code="model_not_found")
    if not 1 <= body.choices <= MAX_CHOICES:
        raise APIError(400, f"n must be an integer in [1, {MAX_CHOICES}], got {body.n}", param="n")
    if body.best_of is not None and body.best_of != body.choices:
        raise APIError(400, "best_of other than n is not supported (no extra candidates are generated)",
                       param="best_of")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    for key, value in (body.model_extra or {}).items():
        if key in UNSUPPORTED and value not in UNSUPPORTED[key]:
            raise APIError(400, f"'{key}' is not supported by this server", param=key)


def _seed(seed: int | None, choice: int) -> int | None:
    """Choice i's seed: ``seed + i``, wrapped into 64-bit signed integers."""
    if seed is None or not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        return seed   # an out-of-range seed is SamplingParams' 400
    return (seed + choice - SEED_RANGE[0]) % 2**64 + SEED_RANGE[0]


def sampling_params(body: _Body, max_tokens: int, stop: list[str], logprobs: int | None,
                    max_param: str = "max_tokens", stop_token_ids: list[int] | None = None) -> list[SamplingParams]:
    """One SamplingParams per choice; with a ``seed``, choice i samples with ``seed + i``."""
    defaults = SamplingParams()
    try:
        return [SamplingParams(
            max_tokens=max_tokens,
            temperature=defaults.temperature if body.temperature is None else body.temperature,
            top_p=defaults.top_p if body.top_p is None else body.top_p,
            top_k=defaults.top_k if body.top_k is None else body.top_k, seed=_seed(body.seed, i), stop=stop,
            logprobs=logprobs, ignore_eos=bool(body.ignore_eos), stop_token_ids=list(stop_token_ids or []),
            min_tokens=body.min_tokens or 0,
            **{name: getattr(body, name) for name in PENALTIES if getattr(body, name) is not None})
            for i in range(body.choices)]
    except ValueError as err:
        field = str(err).split(" ", 1)[0]
        field = max_param if field == "max_tokens" else field
        raise APIError(400, str(err), param=field if field in ChatBody.model_fields else None) from None


def check_chars(chars: int, token_chars: int | None, max_context: int, param: str) -> None:
    """Refuse, before tokenising it, a text too long to fit the context whatever its tokens."""
    if token_chars is not None and chars > token_chars * max_context:
        raise APIError(400, f"This model's maximum context length is {max_context} tokens. However, your "
                       f"{param} has {chars:,} characters, so at least {chars // token_chars + 1:,} tokens. "
                       "Please reduce the prompt.", param=param, code="context_length_exceeded")


def check_context(prompt_len: int, max_tokens: int, max_context: int, param: str) -> None:
    if prompt_len + max_tokens > max_context:
        raise APIError(400, f"This model's maximum context length is {max_context} tokens. However, you requested "
                       f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                       "completion). Please reduce the prompt or max_tokens.", param=param,
                       code="context_length_exceeded")


# -- errors in OpenAI's shape (the app's exception handlers) ---------------------------------------------
def _loc(loc: tuple[Any, ...]) -> str | None:
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
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


async def api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = f"Invalid URL ({request.method} {request.url.path})" if exc.status_code == 404 else str(exc.detail)
    return APIError(exc.status_code, message, code=None).response()


# -- token strings and log-probabilities ----------------------------------------------------------------
@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (what HF ``tokenizers``' ByteLevel uses): character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(rest)}


class TokenStrings:
    """Token id -> (text, bytes) for log-probabilities. With a byte-level BPE the bytes are the token's own,
    exactly (a token ending inside a multi-byte character has U+FFFD in its text, and its real bytes, so the
    bytes of consecutive tokens join to the output's UTF-8); otherwise the text is ``decode([id])`` and the
    bytes its UTF-8. An id outside the tokenizer's vocabulary (a model's vocabulary may be larger) is
    ``("", [])``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.byte_level = type(getattr(tokenizer, "decoder", None)).__name__ == "ByteLevel"
        self.get = functools.lru_cache(maxsize=2**16)(self._render)

    def _render(self, token_id: int) -> tuple[str, list[int]]:
        try:
            piece = self.tokenizer.id_to_token(token_id)
        except (OverflowError, TypeError, ValueError):   # negative or beyond 64 bits
            piece = None
        if piece is None:
            return "", []
        alphabet = _byte_level_alphabet()
        if self.byte_level and all(c in alphabet for c in piece):
            raw = bytes(alphabet[c] for c in piece)
            return raw.decode("utf-8", errors="replace"), list(raw)
        text = piece if self.byte_level else self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text, list(text.encode("utf-8"))


def _finite(logprob: float | None) -> float | None:
    return logprob if logprob is None or math.isfinite(logprob) else NO_LOGPROB


class LogprobLog:
    """One choice's token log-probabilities in its endpoint's shape, added per token event and taken per
    chunk, so that each chunk carries the entries of the tokens it covers (one per token, even while the
    token's text is held back)."""

    def __init__(self, chat: bool, top_n: int, strings: TokenStrings) -> None:
        self.chat, self.top_n, self.strings = chat, top_n, strings
        self.items: list[Any] = []
        self.offset = 0   # completions' text_offset: the characters of the token texts before this one

    def add(self, event: TokenEvent) -> None:
        if event.token_id is None:
            return
        text, raw = self.strings.get(event.token_id)
        top = (event.top_logprobs or [])[:self.top_n]
        if self.chat:
            alternatives = []
            for token_id, logprob in top:
                alt_text, alt_raw = self.strings.get(token_id)
                alternatives.append({"token": alt_text, "logprob": _finite(logprob), "bytes": alt_raw})
            self.items.append({"token": text, "logprob": _finite(event.logprob), "bytes": raw,
                               "top_logprobs": alternatives})
        else:
            best: dict[str, float | None] = {}
            for token_id, logprob in top:   # two ids of one text (broken UTF-8): the likelier one
                best.setdefault(self.strings.get(token_id)[0], _finite(logprob))
            self.items.append((text, _finite(event.logprob), best, self.offset))
            self.offset += len(text)

    def take(self, always: bool = False) -> dict[str, Any] | None:
        """The entries added since the last take, in the endpoint's shape; None if there are none (unless
        ``always``: the full response says "no tokens" with empty lists)."""
        items, self.items = self.items, []
        if not items and not always:
            return None
        if self.chat:
            return {"content": items}
        columns = [list(column) for column in zip(*items)] or [[], [], [], []]
        return dict(zip(("tokens", "token_logprobs", "top_logprobs", "text_offset"), columns))


# -- response shapes ------------------------------------------------------------------------------------
def usage_json(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens, "image_tokens": usage.image_tokens},
            "cost_usd": usage.cost_usd}


def sse(body: dict[str, Any] | str) -> bytes:
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class _Choice:
    def __init__(self, logprobs: LogprobLog | None) -> None:
        self.logprobs = logprobs
        self.texts: list[str] = []
        self.tokens = 0
        self.finish: str | None = None
        self.usage: Usage | None = None


class Shape:
    """Builds the JSON of one request of one endpoint (``text_completion`` or ``chat.completion``) from the
    events of its ``n`` choices, which may arrive interleaved: ``stream`` turns an event into SSE chunks,
    ``add`` keeps it for ``full``. Usage is OpenAI's: the prompt counted once (with the first choice's
    cached tokens), the completion tokens of all choices summed."""

    def __init__(self, kind: Literal["completions", "chat"], rid: str, model: str, n: int, prompt_len: int,
                 logprobs: int | None, strings: TokenStrings, include_usage: bool = False) -> None:
        self.chat, self.rid, self.model, self.include_usage = kind == "chat", rid, model, include_usage
        self.prompt_len, self.created = prompt_len, int(time.time())
        self.choices = [_Choice(None if logprobs is None else LogprobLog(self.chat, logprobs, strings))
                        for _ in range(n)]

    @property
    def done(self) -> bool:
        return all(choice.finish is not None for choice in self.choices)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def _note(self, index: int, event: TokenEvent) -> _Choice:
        choice = self.choices[index]
        choice.tokens += event.token_id is not None
        if choice.logprobs is not None:
            choice.logprobs.add(event)
        if event.finished:
            choice.finish, choice.usage = event.finish_reason or "stop", event.usage
        return choice

    def chunk(self, index: int, text: str | None, finish: str | None = None, role: bool = False,
              logprobs: dict[str, Any] | None = None) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            body = self._head("chat.completion.chunk") | {"choices": [choice]}
        else:
            body = self._head("text_completion") | {
                "choices": [{"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}]}
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def opening(self) -> bytes:
        """What a stream starts with: chat's role chunk for each choice."""
        return b"".join(self.chunk(i, None, role=True) for i in range(len(self.choices))) if self.chat else b""

    def stream(self, index: int, event: TokenEvent) -> bytes:
        """The chunks of choice ``index``'s event: its text (with the log-probabilities of the tokens since
        the last chunk), then, if it is the last, the finish reason (with any tokens not yet covered)."""
        choice = self._note(index, event)
        out = b""
        if event.text:
            out += self.chunk(index, event.text, logprobs=choice.logprobs and choice.logprobs.take())
        if event.finished:
            out += self.chunk(index, None, choice.finish, logprobs=choice.logprobs and choice.logprobs.take())
        return out

    def add(self, index: int, event: TokenEvent) -> None:
        self._note(index, event).texts.append(event.text)

    def usage(self) -> Usage:
        first = self.choices[0].usage or Usage(self.prompt_len, 0, 0)
        completion = sum(c.usage.completion_tokens if c.usage else c.tokens for c in self.choices)
        return Usage(first.prompt_tokens, completion, first.cached_tokens, first.image_tokens)

    def usage_chunk(self) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(self._head(obj) | {"choices": [], "usage": usage_json(self.usage())})

    def full(self) -> dict[str, Any]:
        choices = []
        for index, choice in enumerate(self.choices):
            text = "".join(choice.texts)
            logprobs = choice.logprobs and choice.logprobs.take(always=True)
            content = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            choices.append({"index": index} | content | {"logprobs": logprobs, "finish_reason": choice.finish})
        obj = "chat.completion" if self.chat else "text_completion"
        return self._head(obj) | {"choices": choices, "usage": usage_json(self.usage())}
