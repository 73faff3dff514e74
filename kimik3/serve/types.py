"""The serving contract: what a request asks for and what the engine streams back.

The HTTP server (``server.py``) speaks only these types to the engine (``engine.py``), and the
engine speaks only these to the scheduler, so each side can be tested against a fake of the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]

# K3's published prices, USD per million tokens (the map's SERVING box).
PRICE_CACHED_INPUT = 0.30
PRICE_UNCACHED_INPUT = 3.00
PRICE_OUTPUT = 15.00


class AdmissionRejected(Exception):
    """The engine's queue is full: the request was refused (HTTP 429), nothing was allocated."""


class RequestTooLong(ValueError):
    """The prompt plus max_tokens does not fit the model's context (HTTP 400)."""


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0: no top-k cut
    seed: int | None = None
    stop: list[str] = field(default_factory=list)   # stop strings; the match is not returned

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if len(self.stop) > 4 or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be at most 4 non-empty strings")


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int          # prompt tokens served from the prefix cache (not recomputed)

    @property
    def cost_usd(self) -> float:
        return request_cost(self.prompt_tokens, self.cached_tokens, self.completion_tokens)


def request_cost(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
    """USD at K3's prices: cached prompt tokens, uncached prompt tokens, output tokens."""
    uncached = prompt_tokens - cached_tokens
    return (cached_tokens * PRICE_CACHED_INPUT + uncached * PRICE_UNCACHED_INPUT
            + completion_tokens * PRICE_OUTPUT) / 1e6


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class TokenEvent:
    """One step of a request's stream. ``text`` is the newly decoded text (may be empty while a
    multi-byte character or a possible stop string is pending). The last event has
    ``finished=True``, a ``finish_reason`` and the ``usage``."""

    request_id: str
    token_id: int | None
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
