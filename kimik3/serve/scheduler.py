"""The scheduler: which sequences run each step, and what becomes of them.

The engine is split as vLLM v1 and nano-vllm split theirs: this scheduler (admission, the step plan, finishing,
events), the cache manager (``cache_manager.py``: MLA blocks, KDA slots, prefix checkpoints) and the model runner
(``model_runner.py``: the forwards, CUDA graphs for decode, sampling on the device).

A step runs at most one chunked-prefill forward and one batched decode forward (every sequence that has its
first token, one token each, ragged lengths through the paged view). The prefill forward holds the next chunk of
the first prefilling sequences (each up to ``prefill_chunk`` tokens, cut at the checkpoint boundaries the prefix
cache planned) as rows padded to the longest, as many as fit ``prefill_chunk`` padded tokens and the runner's
``prefill_rows`` (one sequence where chunks replay CUDA graphs of one row).

Life of a request: queued -> admitted (needs a KDA slot and its whole MLA block reservation: prompt +
max_tokens, so a running sequence never waits for memory; ``CacheManager.admit``) -> restored from the longest
prefix checkpoint, if any -> prefill from the hit, snapshotting KDA at planned boundaries -> decode, snapshotting
at hash boundaries the policy wants -> finished or aborted: slot and blocks freed.

Images (a model with a vision tower): a request's images enter at prefill only, as embeddings written over their
placeholders, and the prefix cache keys them by content (``multimodal.py``); decode never sees them.

Failures are contained per request: an exception while one sequence is checkpointed or streamed ends that
sequence alone with ``finish_reason="error"`` (its cache freed) and the others go on; a failed forward or its
sampling (batched prefill or decode) ends the sequences of that batch. Only ``BROKEN_AFTER`` failed forwards in a
row (a broken device, not a bad request) escape ``step`` as ``EngineBroken``.

This class is single-threaded; ``engine.LLMEngine`` runs it on a worker thread.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from typing import Any

import torch

from kimik3.model.draft import EagleDraft
from kimik3.model.k3 import K3ForCausalLM
from kimik3.serve.cache_manager import CacheManager
from kimik3.serve.detokenize import StreamDetokenizer
from kimik3.serve.memory import EngineConfig, gpu_cache_budget, plan_cache
from kimik3.serve.images import ImageRule
from kimik3.serve.model_runner import ModelRunner, Sampled
from kimik3.serve.multimodal import ImageEmbedder, MediaSpan, MediaTokens, media_spans
from kimik3.serve.sequence import EventSink, Sequence
from kimik3.serve.speculative import eligible
from kimik3.serve.types import (AdmissionRejected, EngineStats, FinishReason, GenerationRequest,
                                RequestTooLong, TokenEvent, Usage)

log = logging.getLogger(__name__)
BROKEN_AFTER = 3   # failed forwards in a row after which the engine, not a request, is at fault


class EngineBroken(RuntimeError):
    """Forwards keep failing whatever the batch: the engine cannot serve until it is rebuilt."""


class EngineCore:
    def __init__(self, model: K3ForCausalLM, tokenizer: Any, config: EngineConfig,
                 eos_token_id: int | None = None, draft: EagleDraft | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.max_context = min(config.max_context or model.config.max_seq_len, model.config.max_seq_len)
        if config.gpu_memory_utilization is not None and model.device.type == "cuda":
            config = dataclasses.replace(config, memory_bytes=gpu_cache_budget(model, config))
        self.config = config
        self.image_rule = ImageRule.of(model.config)   # None: a text-only model, which refuses images
        self.layout = plan_cache(model.config, config, model.dtype)
        self.cache = CacheManager(model.config, config, self.layout, model.dtype, model.device)
        self.runner = ModelRunner(model, self.cache, config, self.max_context, draft, eos_token_id)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._counters = EngineStats()
        self._failed_forwards = 0

    @property
    def prefix_cache(self):
        return self.cache.prefix_cache

    def describe(self) -> str:
        """The start-up line: the cache budget and how decode and prefill run."""
        runner = self.runner
        graphs = (f"decode as CUDA graphs for batches {', '.join(map(str, sorted(runner.graphs)))}, prefill chunks "
                  f"as piecewise graphs of {', '.join(map(str, sorted(runner.prefill_graphs)))} tokens (captured in "
                  f"{runner.capture_seconds:.1f} s)" if runner.uses_graphs else "eager decode and prefill")
        cache = self.layout.describe(self.config.physical_block, self.config.max_running, self.max_context)
        if runner.speculator is not None:
            graphs += (f"; speculative decoding: {runner.speculator.tokens} drafted tokens a step (draft features "
                       f"from layers {', '.join(map(str, runner.speculator.feature_layers))} and the last)")
        return f"{cache}; {graphs}"

    # ------------------------------------------------------------------ admission
    def check(self, request: GenerationRequest) -> None:
        """Raise ``RequestTooLong`` for a request that could never run; ValueError for bad ids."""
        prompt, params = request.prompt_ids, request.params
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        self._spans(request)
        total = len(prompt) + params.max_tokens
        if total > self.max_context:
            raise RequestTooLong(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                                 f"exceeds the context of {self.max_context} tokens")
        if self.cache.blocks_needed(total) > self.layout.num_blocks:
            raise RequestTooLong(f"{total} tokens need {self.cache.blocks_needed(total)} cache blocks; the engine "
                                 f"has {self.layout.num_blocks}")

    def _spans(self, request: GenerationRequest) -> tuple[MediaSpan, ...]:
        """The placeholder span of each of the request's images (``serve/multimodal.py``); ValueError when the
        model has no vision tower or the prompt's placeholders do not match its images."""
        if not request.images:
            return ()
        if self.image_rule is None:
            raise ValueError("this model has no vision tower: it cannot take images")
        rule = self.image_rule
        for i, image in enumerate(request.images):
            rows, cols = image.grid
            if (rows % rule.merge_size or cols % rule.merge_size
                    or image.num_tokens != rows * cols // rule.merge_size ** 2
                    or tuple(image.pixel_values.shape) != (rows * cols, 3 * rule.patch_size ** 2)):
                raise ValueError(f"image {i} was not prepared for this model's tower (grid {image.grid}, "
                                 f"pixel_values {tuple(image.pixel_values.shape)}, {image.num_tokens} tokens)")
        return media_spans(request.prompt_ids, request.images, rule.image_token_id)

    def add(self, request: GenerationRequest, sink: EventSink) -> None:
        """Queue a request (after ``check``); refuse it when more than ``max_waiting`` requests
        would be left waiting. Admission is tried first, so a request that can start now is never
        refused (``max_waiting=0`` means: no queue, not: no requests)."""
        self.check(request)
        params = request.params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.model.device).manual_seed(params.seed)
        spans = self._spans(request)
        seq = Sequence(request, sink, StreamDetokenizer(self.tokenizer, params.stop), generator,
                       tokens=MediaTokens(request.prompt_ids, spans) if spans else list(request.prompt_ids),
                       media=ImageEmbedder(request.images, spans) if spans else None)
        self.waiting.append(seq)
        if len(self.waiting) > self.config.max_waiting:
            self._admit()
        if len(self.waiting) > self.config.max_waiting and self.waiting[-1] is seq:
            self.waiting.pop()
            self._counters.rejected += 1
            raise AdmissionRejected(f"{len(self.waiting)} requests are already waiting (limit "
                                    f"{self.config.max_waiting}); retry later")

    def abort(self, request_id: str) -> bool:
        for seq in list(self.waiting):
            if seq.request.request_id == request_id:
                self.waiting.remove(seq)
                self._emit_finish(seq, "abort", count=False)   # never ran: nothing to bill
                return True
        for seq in self.running:
            if seq.request.request_id == request_id:
                self._finish(seq, "abort")
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            try:
                if not self.cache.admit(seq):
                    return                           # wait for running sequences to free blocks
            except Exception as error:
                self.waiting.popleft()
                self._fail(seq, error)
                continue
            self.waiting.popleft()
            self.running.append(seq)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> None:
        self._admit()
        decoding = [seq for seq in self.running if not seq.prefilling]
        prefilling = self._prefill_plan([seq for seq in self.running if seq.prefilling])
        if prefilling:
            self._prefill(*prefilling)
        if decoding:
            self._decode(decoding)

    def _forward_failed(self, seqs: list[Sequence], error: Exception) -> None:
        """A batched forward raised: its sequences end with the error; repeated failures whatever
        the batch mean the engine itself is broken (``EngineBroken``)."""
        self._failed_forwards += 1
        for seq in seqs:
            self._fail(seq, error)
        if self._failed_forwards >= BROKEN_AFTER:
            raise EngineBroken(f"{self._failed_forwards} forwards in a row failed; the last: "
                               f"{type(error).__name__}: {error}") from error

    def _chunk_end(self, seq: Sequence) -> int:
        """Where ``seq``'s next prefill chunk ends: ``prefill_chunk`` tokens on, cut at the prompt's end and at the
        next checkpoint boundary the prefix cache planned (passed ones dropped)."""
        while seq.boundaries and seq.boundaries[0] <= seq.computed:
            seq.boundaries.popleft()
        end = min(seq.computed + self.config.prefill_chunk, seq.prompt_len)
        return min(end, seq.boundaries[0]) if seq.boundaries else end

    def _prefill_plan(self, waiting: list[Sequence]) -> tuple[list[Sequence], list[int]] | None:
        """This step's prefill: the first prefilling sequences, in admission order, while the forward's padded size
        (rows x the longest chunk) stays within ``prefill_chunk`` and the rows within the runner's
        ``prefill_rows``; at least the first. None when nothing prefills."""
        if not waiting:
            return None
        seqs, ends, longest = [], [], 0
        for seq in waiting[:self.runner.prefill_rows]:
            end = self._chunk_end(seq)
            longest_with = max(longest, end - seq.computed)
            if seqs and (len(seqs) + 1) * longest_with > self.config.prefill_chunk:
                break
            seqs.append(seq)
            ends.append(end)
            longest = longest_with
        return seqs, ends

    def _prefill(self, seqs: list[Sequence], ends: list[int]) -> None:
        """One prefill forward over the chunks ``seq.tokens[seq.computed:end]``; a sequence whose prompt is then
        complete samples its first token, and one that reached a planned boundary is checkpointed."""
        try:
            logits_BV = self.runner.prefill_many(seqs, ends)
            done = [row for row, (seq, end) in enumerate(zip(seqs, ends)) if end == seq.prompt_len]
            firsts = dict(zip(done, self.runner.sample([seqs[row] for row in done], logits_BV[done]))) if done else {}
        except Exception as error:
            self._forward_failed(seqs, error)
            return
        self._failed_forwards = 0
        for row, (seq, end) in enumerate(zip(seqs, ends)):
            try:
                seq.computed = end
                if seq.boundaries and seq.boundaries[0] == end:
                    seq.boundaries.popleft()
                    self.cache.snapshot_prompt(seq)
                if row in firsts:
                    self._accept(seq, firsts[row])
            except Exception as error:
                self._fail(seq, error)

    def _decode(self, seqs: list[Sequence]) -> None:
        if self.runner.speculator is not None:
            speculating, plain = [], []
            for seq in seqs:
                (speculating if eligible(seq) else plain).append(seq)
            if speculating:
                self._speculate(speculating)
            seqs = plain
            if not seqs:
                return
        try:
            sampled = self.runner.sample(seqs, self.runner.decode(seqs))
        except Exception as error:
            self._forward_failed(seqs, error)
            return
        self._failed_forwards = 0
        for seq, next_token in zip(seqs, sampled):
            try:
                seq.computed += 1
                self.cache.maybe_snapshot_decode(seq)
                self._accept(seq, next_token)
            except Exception as error:
                self._fail(seq, error)

    def _speculate(self, seqs: list[Sequence]) -> None:
        """One speculative step (``serve/speculative.py``): each sequence emits 1 to K + 1 tokens."""
        try:
            emitted = self.runner.speculator.step(seqs)
        except Exception as error:
            self._forward_failed(seqs, error)
            return
        self._failed_forwards = 0
        for seq, tokens in zip(seqs, emitted):
            try:
                seq.computed += len(tokens)
                seq.spec_pending = len(tokens)
                for token in tokens:
                    self._accept(seq, Sampled(token))
                    if seq not in self.running:   # finished (or failed to stream) within the step's tokens
                        break
                else:
                    # After the tokens are appended: the cache now holds all but the last of them. A checkpoint
                    # is offered when the cached length lands on a hash boundary (a step of several tokens may
                    # pass over one).
                    self.cache.maybe_snapshot_decode(seq)
            except Exception as error:
                self._fail(seq, error)

    def _accept(self, seq: Sequence, sampled: Sampled) -> None:
        """Stream the sampled next token of ``seq``, and finish the sequence if it is done."""
        params = seq.request.params
        token = sampled.token
        seq.tokens.append(token)
        logprobs = dict(logprob=sampled.logprob, top_logprobs=sampled.top_logprobs)
        if (token == self.eos_token_id and not params.ignore_eos) or token in params.stop_token_ids:
            self._finish(seq, "stop", seq.detokenizer.flush(), token, logprobs)
            return
        text = seq.detokenizer.push(token)
        if seq.detokenizer.stopped:
            self._finish(seq, "stop", text, token, logprobs)
        elif seq.generated >= params.max_tokens:
            self._finish(seq, "length", text + seq.detokenizer.flush(), token, logprobs)
        elif not self._send(seq, TokenEvent(seq.request.request_id, token, text, **logprobs)):
            self._finish(seq, "abort")                 # nobody is listening any more

    def _send(self, seq: Sequence, event: TokenEvent) -> bool:
        """Hand ``event`` to the request's sink; False (logged) if the sink raised: a caller whose
        event loop is gone must not take the engine down."""
        try:
            seq.sink(event)
            return True
        except Exception:
            log.exception("delivering an event of request %s failed", seq.request.request_id)
            return False

    # ------------------------------------------------------------------ the end
    def _finish(self, seq: Sequence, reason: FinishReason, text: str = "", token: int | None = None,
                logprobs: dict | None = None) -> None:
        """End ``seq``; ``token`` is the last sampled one (it rides on the final event, with its
        ``logprobs``), None on abort."""
        if reason != "abort":
            self.prefix_cache.finish(seq.tokens)
        self._release(seq)
        self._emit_finish(seq, reason, text, token, logprobs=logprobs)

    def _fail(self, seq: Sequence, error: BaseException) -> None:
        """End ``seq`` alone after ``error``; whatever it held (slot, blocks, pin) is freed."""
        log.error("request %s failed: %s: %s", seq.request.request_id, type(error).__name__, error,
                  exc_info=(type(error), error, error.__traceback__))
        self._release(seq)
        self._emit_finish(seq, "error", error=f"{type(error).__name__}: {error}")

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.cache.release(seq)

    def _emit_finish(self, seq: Sequence, reason: FinishReason, text: str = "", token: int | None = None,
                     count: bool = True, error: str | None = None, logprobs: dict | None = None) -> None:
        usage = Usage(prompt_tokens=seq.prompt_len, completion_tokens=seq.generated, cached_tokens=seq.cached_tokens,
                      image_tokens=sum(image.num_tokens for image in seq.request.images))
        if count:
            counters = self._counters
            counters.prompt_tokens += usage.prompt_tokens
            counters.cached_prompt_tokens += usage.cached_tokens
            counters.completion_tokens += usage.completion_tokens
            counters.cost_usd += usage.cost_usd
        self._send(seq, TokenEvent(seq.request.request_id, token, text, finished=True, finish_reason=reason,
                                   usage=usage, error=error, **(logprobs or {})))

    def fail_all(self, error: BaseException) -> None:
        """End every queued and running request with ``error`` (the engine is being rebuilt or stopped)."""
        for seq in list(self.waiting) + list(self.running):
            self._emit_finish(seq, "error", count=False, error=f"the engine failed: {type(error).__name__}: {error}")
        self.waiting.clear()
        self.running.clear()

    def stats(self) -> EngineStats:
        counters, cache_stats = self._counters, self.prefix_cache.stats
        return EngineStats(
            running=len(self.running), waiting=len(self.waiting),
            cache_blocks_used=self.cache.allocator.num_used, cache_blocks_total=self.cache.allocator.num_blocks,
            checkpoints_used=len(self.prefix_cache), checkpoints_total=self.config.checkpoints,
            prefix_queries=cache_stats.queries, prefix_hits=cache_stats.hits,
            prompt_tokens=counters.prompt_tokens, cached_prompt_tokens=counters.cached_prompt_tokens,
            completion_tokens=counters.completion_tokens, cost_usd=counters.cost_usd, rejected=counters.rejected,
            **self._spec_stats())

    def _spec_stats(self) -> dict:
        speculator = self.runner.speculator
        if speculator is None:
            return {}
        s = speculator.stats
        return dict(spec_proposed=tuple(s.proposed), spec_accepted=tuple(s.accepted), spec_steps=s.steps,
                    spec_emitted=s.emitted, spec_draft_seconds=s.draft_seconds, spec_verify_seconds=s.verify_seconds)
