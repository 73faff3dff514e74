"""``LLMEngine``: the engine core on a worker thread, with an asyncio streaming front.

The core (``scheduler.EngineCore``) is single-threaded; one worker thread owns it and runs steps
while there is work, sleeping on a condition otherwise. Callers on any thread submit and abort
under one lock; events travel back to each caller's event loop with ``call_soon_threadsafe``.

Supervision: the core ends a request that fails on its own (``finish_reason="error"``); an error
that escapes a step (``EngineBroken``, or a bug in the core's bookkeeping) ends every request with
the error and the core is rebuilt from scratch (fresh cache pools, empty prefix cache). After
``MAX_RESTARTS`` rebuilds within ``RESTART_WINDOW_S`` the engine gives up: ``health()`` names the
error, new requests are refused, and ``kimik3 serve`` exits non-zero so a process supervisor
can restart it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kimik3.model.draft import EagleDraft
from kimik3.model.k3 import K3ForCausalLM
from kimik3.model.pretrained import has_weights
from kimik3.serve.memory import EngineConfig
from kimik3.serve.multimodal import MediaTokens, media_spans
from kimik3.serve.scheduler import EngineCore
from kimik3.serve.types import EngineStats, EngineUnavailable, GenerationRequest, SamplingParams, TokenEvent

log = logging.getLogger(__name__)
MAX_RESTARTS = 3          # core rebuilds tolerated within RESTART_WINDOW_S before giving up
RESTART_WINDOW_S = 60.0


class LLMEngine:
    """Serve one model replica. ``generate`` follows ``types.EngineLike``."""

    def __init__(self, model: K3ForCausalLM, tokenizer: Any, config: EngineConfig | None = None,
                 model_name: str = "kimik3", eos_token_id: int | None = None, draft: EagleDraft | None = None):
        self._build = lambda: EngineCore(model, tokenizer, config or EngineConfig(), eos_token_id, draft)
        self.core = self._build()
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.max_context = self.core.max_context
        self.image_rule = self.core.image_rule   # how the model tokenises images; None: text only
        self._lock = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None     # set once the engine gave up
        self._restarts: list[float] = []               # monotonic times of recent core rebuilds
        self._thread = threading.Thread(target=self._loop, name=f"{model_name}-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_run(cls, run_dir: str | Path, config: EngineConfig | None = None,
                 device: str | torch.device = "cpu", model_name: str | None = None) -> "LLMEngine":
        """Load a run written by ``kimik3 train`` or ``kimik3 convert`` (``config.json``, the weights in either
        layout, ``tokenizer.json``); with ``config.speculative_tokens``, also its draft (``kimik3 train-draft``)."""
        from kimik3.tokenizer import EOS, load_tokenizer

        run = Path(run_dir)
        for name in ("config.json", "tokenizer.json"):
            if not (run / name).is_file():
                raise FileNotFoundError(f"{run / name} is missing: is {run} a run written by `kimik3 train`?")
        if not has_weights(run):
            raise FileNotFoundError(f"{run}: no model.safetensors nor model.safetensors.index.json: is {run} a run "
                                    f"written by `kimik3 train` or `kimik3 convert`?")
        from kimik3.model.pretrained import read_config
        from kimik3.model.vision import causal_lm_class

        model = causal_lm_class(read_config(run)[0]).from_pretrained(run, device=device)
        draft = EagleDraft.load(run, model) if config is not None and config.speculative_tokens else None
        # The chat template's role markers become special tokens where the model's vocabulary has room for them.
        tokenizer = load_tokenizer(run / "tokenizer.json", vocab_size=model.config.vocab_size)
        return cls(model, tokenizer, config, model_name=model_name or run.name, eos_token_id=tokenizer.token_to_id(EOS),
                   draft=draft)

    # ------------------------------------------------------------------ worker
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self.core.has_work():
                    self._lock.wait()
                if self._closed:
                    return
                try:
                    self.core.step()
                except Exception as error:   # a crashed core must not hang its callers
                    if not self._recover(error):
                        return
            # Let submitters and aborts in between steps (the lock is not fair otherwise).
            time.sleep(0)

    def _recover(self, error: Exception) -> bool:
        """End every request with ``error`` and rebuild the core; False once the engine gave up."""
        log.error("the engine failed: %s: %s", type(error).__name__, error,
                  exc_info=(type(error), error, error.__traceback__))
        self.core.fail_all(error)
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S] + [now]
        if len(self._restarts) > MAX_RESTARTS:
            self._error = error
            log.critical("the engine failed %d times within %.0f s: giving up", len(self._restarts),
                         RESTART_WINDOW_S)
            return False
        self.core = None                                  # let the old pools go before the new ones
        gc.collect()                                      # (the core holds reference cycles)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        try:
            self.core = self._build()
        except Exception as rebuild_error:
            self._error = rebuild_error
            log.critical("rebuilding the engine failed: %s", rebuild_error)
            return False
        log.warning("the engine was rebuilt (%d rebuild(s) in the last %.0f s)", len(self._restarts),
                    RESTART_WINDOW_S)
        return True

    def health(self) -> str | None:
        """None while the engine can serve; otherwise why it cannot."""
        if self._error is not None:
            return f"the engine stopped after an error: {type(self._error).__name__}: {self._error}"
        if self._closed:
            return "the engine is closed"
        if not self._thread.is_alive():
            return "the engine's worker thread is not running"
        return None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ submission
    def submit(self, request: GenerationRequest, sink: Callable[[TokenEvent], None]) -> None:
        """Queue ``request``; ``sink`` is called on the worker thread with each event.
        Raises RequestTooLong / AdmissionRejected / ValueError / EngineUnavailable synchronously."""
        with self._lock:
            reason = self.health()
            if reason is not None:
                raise EngineUnavailable(reason)
            self.core.add(request, sink)
            self._lock.notify_all()

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self.core is not None:
                self.core.abort(request_id)

    def stats(self) -> EngineStats:
        with self._lock:
            return self.core.stats() if self.core is not None else EngineStats()

    def prefix_match(self, prompt_ids: list[int], images: list | None = None) -> int:
        """Tokens of ``prompt_ids`` (with its ``images``) a request sent here now would restore from the prefix
        cache."""
        with self._lock:
            if self.core is None:
                return 0
            if images and self.image_rule is not None:
                try:
                    prompt_ids = MediaTokens(prompt_ids, media_spans(prompt_ids, images,
                                                                     self.image_rule.image_token_id))
                except ValueError:   # the engine refuses it on submission
                    return 0
            return self.core.prefix_cache.match_length(prompt_ids)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.submit(request, lambda event: loop.call_soon_threadsafe(queue.put_nowait, event))
        finished = False
        try:
            while not finished:
                event = await queue.get()
                finished = event.finished
                yield event
        finally:
            if not finished:   # the consumer went away: free the sequence's cache now
                self.abort(request.request_id)

    # ------------------------------------------------------------------ blocking helpers
    def generate_blocking(self, request: GenerationRequest) -> Iterator[TokenEvent]:
        """The same stream for synchronous callers (CLI, benchmarks, tests)."""
        import queue as queue_module

        events: queue_module.Queue[TokenEvent] = queue_module.Queue()
        self.submit(request, events.put)
        while True:
            event = events.get()
            yield event
            if event.finished:
                return

    def complete(self, prompt_ids: list[int], params: SamplingParams | None = None,
                 request_id: str = "blocking") -> tuple[list[int], TokenEvent]:
        """Run one request to the end: (generated token ids, final event)."""
        request = GenerationRequest(request_id, list(prompt_ids), params or SamplingParams())
        tokens: list[int] = []
        for event in self.generate_blocking(request):
            if event.token_id is not None:
                tokens.append(event.token_id)
            if event.finished:
                return tokens, event
        raise AssertionError("unreachable")
