"""A deterministic stand-in for the engine, so the HTTP server can be tested without a model.

``FakeEngine`` implements ``EngineLike`` with a real (tiny, trained in memory) byte-level BPE, and
"generates" by echoing the prompt's tokens in a loop: token i of the reply is ``prompt_ids[i % n]``.
So the output text is predictable, stop strings and ``<|endoftext|>`` (put id 0 in the prompt) can
be provoked on purpose (``ignore_eos`` echoes past it, ``min_tokens`` until then), and sampling
parameters are accepted but ignored, except ``logprobs``: each token then carries the deterministic
``fake_logprobs`` (the token itself the likeliest, as a greedy pick would be). It keeps the bookkeeping
tests assert on: ``allocated`` cache blocks of live requests (must return to 0 after aborts and
disconnects), admission with ``capacity`` running + ``queue_limit`` waiting, and a toy prefix
cache (longest common prefix with earlier sequences) that fills ``Usage.cached_tokens``. Setting
``paused`` holds every admitted request before its next token, so a test can fill the queue exactly.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from typing import Any

from kimik3.serve.types import (AdmissionRejected, EngineStats, FinishReason, GenerationRequest, RequestTooLong,
                                TokenEvent, Usage)

EOS = "<|endoftext|>"
_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "System: You are a helpful assistant.\n\nUser: Hello there!\n\nAssistant: Hi, how can I help?\n\n",
    "Kimi K3 serves requests with a paged cache and a prefix cache.",
    "def hello(name):\n    return f'hello {name}'\n",
]


@functools.cache
def tiny_tokenizer() -> Any:
    """A byte-level BPE (vocab 320, ``<|endoftext|>`` = id 0), the recipe of ``kimik3.train.tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_SENTENCES * 4, trainer=trainer)
    return tokenizer


def fake_logprobs(token: int, top_n: int, vocab: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability FakeEngine reports for ``token`` and its ``top_n`` alternatives: ``token`` itself
    first, then the ids after it (mod ``vocab``), each one nat less likely."""
    logprob = -0.05 - (token % 10) / 10
    return logprob, [((token + j) % vocab, logprob - j) for j in range(top_n)]


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing chars to withhold: an incomplete UTF-8 char, or a possible stop-string start."""
    hold = len(text) - len(text.rstrip("\ufffd"))
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                hold = max(hold, k)
                break
    return hold


class FakeEngine:
    """A test double of ``LLMEngine``: deterministic echo generation, real admission and accounting."""

    def __init__(self, *, model_name: str = "fake-k3", max_context: int = 512, capacity: int = 4,
                 queue_limit: int = 16, token_delay: float = 0.0, block_size: int = 16,
                 prefix_store: int = 64) -> None:
        self.model_name = model_name
        self.max_context = max_context
        self.tokenizer = tiny_tokenizer()
        self.eos_token_id: int | None = self.tokenizer.token_to_id(EOS)
        self.capacity, self.queue_limit = capacity, queue_limit
        self.token_delay, self.block_size = token_delay, block_size
        self.total_blocks = capacity * -(-max_context // block_size)
        self.allocated = 0                       # cache blocks held by live requests
        self.peak_running = 0
        self.paused = False                      # tests set it to hold every request before its next token
        self.failure: str | None = None          # tests set it to make health() report a dead engine
        self.requests: list[GenerationRequest] = []   # every request seen, in order
        self.abort_calls: list[str] = []         # ids passed to abort()
        self.ended_early: list[str] = []         # ids that ended without stop/length (aborted or closed)
        self._running = self._waiting = 0
        self._abort_flags: set[str] = set()
        self._live: set[str] = set()
        self._slots: asyncio.Semaphore | None = None
        self._store: list[tuple[int, ...]] = []  # earlier sequences: the toy prefix cache
        self._store_limit = prefix_store
        self._totals = EngineStats()

    # -- EngineLike ---------------------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)
        if request_id in self._live:
            self._abort_flags.add(request_id)

    def stats(self) -> EngineStats:
        t = self._totals
        return EngineStats(
            running=self._running, waiting=self._waiting, cache_blocks_used=self.allocated,
            cache_blocks_total=self.total_blocks, checkpoints_used=len(self._store),
            checkpoints_total=self._store_limit, prefix_queries=t.prefix_queries, prefix_hits=t.prefix_hits,
            prompt_tokens=t.prompt_tokens, cached_prompt_tokens=t.cached_prompt_tokens,
            completion_tokens=t.completion_tokens, cost_usd=t.cost_usd, rejected=t.rejected)

    def health(self) -> str | None:
        return self.failure

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Validate and admit on the first ``__anext__`` (the contract), then echo the prompt."""
        self.requests.append(request)
        rid, prompt, params = request.request_id, list(request.prompt_ids), request.params
        n = len(prompt)
        if n == 0 or n + params.max_tokens > self.max_context:
            raise RequestTooLong(f"{n} prompt tokens + {params.max_tokens} > context {self.max_context}")
        if self._running + self._waiting >= self.capacity + self.queue_limit:
            self._totals.rejected += 1
            raise AdmissionRejected(f"{self._running} running, {self._waiting} waiting: queue full")
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.capacity)
        self._live.add(rid)
        self._waiting += 1
        out: list[int] = []
        state = {"slot": False, "blocks": 0, "cached": 0, "done": False}
        try:
            await self._slots.acquire()
            state["slot"] = True
            self._waiting -= 1
            self._running += 1
            self.peak_running = max(self.peak_running, self._running)
            state["cached"] = self._lookup(prompt)
            async for event in self._decode(rid, prompt, params, out, state):
                yield event
        finally:
            if state["slot"]:
                self._running -= 1
                self._slots.release()
            else:
                self._waiting -= 1
            self.allocated -= state["blocks"]
            self._live.discard(rid)
            self._abort_flags.discard(rid)
            if not state["done"]:
                self.ended_early.append(rid)
            t = self._totals
            t.prompt_tokens += n
            t.cached_prompt_tokens += state["cached"]
            t.completion_tokens += len(out)
            t.cost_usd += Usage(n, len(out), state["cached"]).cost_usd

    # -- internals ----------------------------------------------------------------------------------
    def _lookup(self, prompt: list[int]) -> int:
        """Longest common prefix with an earlier sequence (at most n - 1: the last token is recomputed)."""
        self._totals.prefix_queries += 1
        best = 0
        for seq in self._store:
            k = 0
            while k < min(len(seq), len(prompt) - 1) and seq[k] == prompt[k]:
                k += 1
            best = max(best, k)
        self._totals.prefix_hits += best > 0
        return best

    def _grow(self, state: dict, tokens: int) -> None:
        need = -(-tokens // self.block_size)
        self.allocated += need - state["blocks"]
        state["blocks"] = need

    async def _decode(self, rid: str, prompt: list[int], params: Any, out: list[int],
                      state: dict) -> AsyncIterator[TokenEvent]:
        n, sent = len(prompt), 0
        self._grow(state, n)

        vocab = self.tokenizer.get_vocab_size()

        def logprobs(token: int | None) -> dict[str, Any]:
            if params.logprobs is None or token is None:
                return {}
            logprob, top = fake_logprobs(token, params.logprobs, vocab)
            return {"logprob": logprob, "top_logprobs": top}

        def final(token: int | None, text: str, reason: FinishReason) -> TokenEvent:
            state["done"] = reason != "abort"
            if state["done"]:
                self._store = (self._store + [tuple(prompt + out)])[-self._store_limit:]
            return TokenEvent(rid, token, text, True, reason, Usage(n, len(out), state["cached"]), **logprobs(token))

        for i in range(params.max_tokens):
            await asyncio.sleep(self.token_delay)
            while self.paused:
                await asyncio.sleep(0.005)
            if rid in self._abort_flags:
                yield final(None, "", "abort")
                return
            token = prompt[i % n]
            out.append(token)
            self._grow(state, n + len(out))
            if i >= params.min_tokens and ((token == self.eos_token_id and not params.ignore_eos)
                                           or token in params.stop_token_ids):
                # Release the text held back while it could have started a stop string, as the engine does.
                yield final(token, self.tokenizer.decode(out[:-1])[sent:], "stop")
                return
            text = self.tokenizer.decode(out)
            cuts = [text.find(s, max(0, sent - len(s))) for s in params.stop]
            cuts = [c for c in cuts if c >= 0]
            if cuts:
                yield final(token, text[sent:min(cuts)], "stop")
                return
            if i == params.max_tokens - 1:
                yield final(token, text[sent:], "length")
                return
            safe = len(text) - _held_back(text, params.stop)
            yield TokenEvent(rid, token, text[sent:safe], **logprobs(token))
            sent = max(sent, safe)
