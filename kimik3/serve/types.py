"""The serving contract: what a request asks for and what the engine streams back.

The HTTP server (``server.py``) speaks only these types to the engine (``engine.py``), and the
engine speaks only these to the scheduler, so each side can be tested against a fake of the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import AsyncIterator
from typing import Any, Literal, Protocol

from kimik3.model.sampling import check_penalties, check_sampling
from kimik3.serve.cost import request_cost

FinishReason = Literal["stop", "length", "abort", "error"]
SEED_RANGE = (-2**63, 2**63)   # a 64-bit signed integer, as torch.Generator and OpenAI's API take it
MAX_TEMPERATURE = 2.0          # the OpenAI API's bound; the sampler itself takes any finite temperature
MAX_LOGPROBS = 20              # the OpenAI API's bound on top_logprobs

class AdmissionRejected(Exception):
    """The engine's queue is full: the request was refused (HTTP 429), nothing was allocated."""


class RequestTooLong(ValueError):
    """The prompt plus max_tokens does not fit the model's context (HTTP 400)."""


class EngineUnavailable(RuntimeError):
    """The engine cannot serve: it gave up after repeated failures, or it was closed (HTTP 503)."""


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0: no top-k cut
    seed: int | None = None
    stop: list[str] = field(default_factory=list)   # stop strings; the match is not returned
    # Tokens that end the output like the end-of-sequence token (a chat template's end of turn, when it is a special
    # token: decoding skips special tokens, so no stop string can see it); not returned.
    stop_token_ids: list[int] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0      # 1: off
    min_p: float = 0.0                   # 0: off
    # None: no log-probabilities; n >= 0: each token's log-probability and the n likeliest alternatives'
    # (log-softmax of the model's logits before penalties and temperature, as vLLM reports them).
    logprobs: int | None = None
    # "raw": the log-probabilities above; "processed": of the distribution the token is drawn from, the logits after
    # penalties and temperature (before top-p, top-k and min-p truncation): what RL's importance ratios need when it
    # samples at a temperature other than 1 (vLLM's processed_logprobs). Needs temperature > 0.
    logprobs_mode: str = "raw"
    ignore_eos: bool = False             # keep generating past the end-of-sequence token (vLLM's; benchmarks)
    # The end-of-sequence token and ``stop_token_ids`` cannot be drawn before this many tokens (vLLM's): their
    # logits are masked in the distribution sampled from (what "processed" log-probabilities describe). Stop
    # strings still end the output.
    min_tokens: int = 0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if (not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool)
                or not 0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens}], got "
                             f"{self.min_tokens!r}")
        check_sampling(self.temperature, self.top_p, self.top_k, max_temperature=MAX_TEMPERATURE)
        check_penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty, self.min_p)
        if self.seed is not None and not (isinstance(self.seed, int) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63), got {self.seed!r}")
        if len(self.stop) > 4 or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be at most 4 non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {self.stop_token_ids!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}")
        if self.logprobs_mode == "processed" and self.temperature == 0:
            raise ValueError("logprobs_mode 'processed' needs temperature > 0 (greedy decoding draws from no "
                             "distribution)")


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int          # prompt tokens served from the prefix cache (not recomputed)
    image_tokens: int = 0       # prompt tokens that are image placeholders (counted in prompt_tokens too)

    @property
    def cost_usd(self) -> float:
        return request_cost(self.prompt_tokens, self.cached_tokens, self.completion_tokens)


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    # Token positions where a message of the prompt ends (from the chat template): places where a
    # later request is likely to diverge, so the prefix cache may checkpoint them on first sight.
    boundary_hints: list[int] = field(default_factory=list)
    # The prompt's images, in the order of their placeholders (``kimik3.serve.images.PreparedImage``: the tower's
    # input, token count and content digest); only a model with a vision tower takes them.
    images: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class TokenEvent:
    """One step of a request's stream. ``text`` is the newly decoded text (may be empty while a
    multi-byte character or a possible stop string is pending). The last event has
    ``finished=True``, a ``finish_reason`` and the ``usage``; ``finish_reason == "error"`` means
    the engine failed on this request alone, and ``error`` says how."""

    request_id: str
    token_id: int | None
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None
    # With SamplingParams.logprobs: the log-probability of ``token_id`` and the likeliest alternatives
    # as (token id, log-probability), best first.
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class EngineStats:
    """A snapshot of an engine's (or a router's, summed) state, for /metrics and /health."""

    running: int = 0                  # sequences in prefill or decode
    waiting: int = 0                  # admitted to the queue, not yet holding cache
    cache_blocks_used: int = 0        # MLA physical blocks in use (live sequences + cached prefixes)
    cache_blocks_total: int = 0
    checkpoints_used: int = 0         # KDA prefix checkpoints held
    checkpoints_total: int = 0
    prefix_queries: int = 0           # prefix-cache lookups
    prefix_hits: int = 0              # lookups that restored a checkpoint
    prompt_tokens: int = 0            # cumulative
    cached_prompt_tokens: int = 0     # cumulative prompt tokens served from the cache
    completion_tokens: int = 0        # cumulative
    cost_usd: float = 0.0             # cumulative, at K3's prices
    rejected: int = 0                 # requests refused by admission control
    # Speculative decoding, cumulative (``kimik3.serve.speculative.SpecStats``): per chain position, drafts proposed
    # and accepted; sequence-verifications, tokens they emitted, host seconds drafting and verifying.
    spec_proposed: tuple[int, ...] = ()
    spec_accepted: tuple[int, ...] = ()
    spec_steps: int = 0
    spec_emitted: int = 0
    spec_draft_seconds: float = 0.0
    spec_verify_seconds: float = 0.0

    @property
    def cache_usage(self) -> float:
        return self.cache_blocks_used / self.cache_blocks_total if self.cache_blocks_total else 0.0


class EngineLike(Protocol):
    """What the HTTP server needs from an engine (``LLMEngine``, a ``ReplicaRouter`` or a fake).

    ``generate`` validates and admits the request *before* yielding anything: it raises
    ``RequestTooLong`` (400) or ``AdmissionRejected`` (429) on the first ``__anext__``; then it
    yields ``TokenEvent`` s, the last with ``finished=True``. Closing the iterator early (client
    gone) aborts the request and frees its cache. Detokenisation and stop strings are the
    engine's job: ``TokenEvent.text`` is ready to send. ``health()`` is None while the engine can
    serve, else why it cannot (``/health`` answers 503 with it).
    """

    model_name: str
    max_context: int
    tokenizer: Any                    # tokenizers.Tokenizer: .encode(text).ids, .decode(ids)
    eos_token_id: int | None

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def health(self) -> str | None: ...
